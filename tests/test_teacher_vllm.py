"""Integration: a real OpenAI-compatible server (vLLM's, serving the bundled SmolLM2 on 127.0.0.1) judges
real-data rollouts with both built-in policies through HTTP, and through `eviback judge`; then it stops.

The server starts once for this module (1-2 minutes on a small CPU) with a 1 GiB KV cache."""

import json

import pytest

from eviback.cli import main
from eviback.data import write_jsonl
from eviback.policy import resolve_model
from eviback.teacher.cache import MemoryCache
from eviback.teacher.judge import JudgeConfig, Teacher
from eviback.teacher.openai_http import HttpBackendConfig, OpenAIChatClient
from eviback.teacher.policy import load_policy
from eviback.teacher.probes import build_probes
from eviback.teacher.vllm_server import VllmServer, VllmServerConfig
from eviback.types import Status, to_dict

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with VllmServer(VllmServerConfig(model_dir=resolve_model("smollm2-135m"), served_name="smollm2",
                                     kv_cache_gib=1, max_model_len=4096, log_path=str(log))) as s:
        yield s


@pytest.fixture(scope="module")
def probes():
    return build_probes(6, seed=4)


@pytest.mark.parametrize("name, mode", [("two-stage", "response_format"),
                                        ("single-prompt-dual-task", "structured_outputs")])
def test_both_policies_through_http(server, probes, name, mode):
    policy = load_policy(name)
    client = OpenAIChatClient(HttpBackendConfig(base_url=server.base_url, model="smollm2",
                                                structured_output=mode, timeout_s=120))
    cache = MemoryCache()
    with Teacher(policy, client, JudgeConfig(concurrency=4), cache=cache) as teacher:
        verdicts = teacher.judge([p.trajectory for p in probes])
        stats = teacher.stats().total
        again = teacher.judge([p.trajectory for p in probes])  # all from the cache
        warm = teacher.stats().total
    # The server enforces the JSON schema, so the only malformed reply possible is one cut at max_tokens
    # (this small model sometimes lists answers until the budget ends); it must say so, and stay rare.
    errors = [v.error for v in verdicts if v.teacher_error]
    assert len(errors) <= 1 and all("decoding.max_tokens" in e for e in errors), errors
    assert stats.schema_violations == len(errors)
    assert stats.prompt_tokens > 100 * len(probes) and stats.completion_tokens > 0
    for v in verdicts:
        if not v.teacher_error:
            assert v.status in set(Status) and 0.0 <= v.reward <= 1.0
            assert v.stage_b_ran == (len(policy.stages) > 1 and v.stage_a_status is not Status.INSUFFICIENT)
    assert all(a.status == v.status for a, v in zip(again, verdicts, strict=True) if not v.teacher_error)
    # a warm run replays every reply; a failed request is never cached, so it is asked again
    assert warm.cache_hits == stats.requests - len(errors)
    assert (warm.calls == stats.calls) if not errors else (warm.calls > stats.calls)


def test_eviback_judge_command_on_an_eval_style_dump(server, probes, tmp_path, capsys):
    dump = tmp_path / "eval.jsonl"
    write_jsonl(dump, ({"benchmark": "nq", "trajectory": to_dict(p.trajectory)} for p in probes[:3]))
    out, summary = tmp_path / "verdicts.jsonl", tmp_path / "summary.json"
    code = main(["judge", str(dump), "--base-url", server.base_url, "--policy", "two-stage",
                 "--out", str(out), "--summary", str(summary), "--cache", str(tmp_path / "c.sqlite"),
                 "--concurrency", "3"])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["question_id"] for r in rows] == [p.trajectory.question.id for p in probes[:3]]
    report = json.loads(summary.read_text())
    assert report["rollouts"] == 3 and report["errors"] <= 1 and report["backend"] == "openai-http:smollm2"
    assert "rollouts/s" in capsys.readouterr().out
