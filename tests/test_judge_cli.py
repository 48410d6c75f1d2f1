"""`eviback judge`: policies listed, shown, frozen and refused; dumps judged into verdicts and a summary."""

import json

import pytest

from eviback.cli import main
from eviback.data import write_jsonl
from eviback.teacher.policy import load_policy
from eviback.teacher.probes import build_probes
from eviback.types import Verdict, from_dict, to_dict
from log_checks import assert_clean_in_process, capture_command_log
from teacher_fakes import Fault, FaultyChatServer


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    path = tmp_path_factory.mktemp("dump") / "rollouts.jsonl"
    write_jsonl(path, (to_dict(p.trajectory) for p in build_probes(5, seed=9)))  # bare trajectories
    return path


def test_list_and_show_policies(capsys):
    assert main(["judge", "--list-policies"]) == 0
    out = capsys.readouterr().out
    assert load_policy("two-stage").short_version in out and "boundary-compliant" in out
    assert main(["judge", "--show-policy", "two-stage"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "two-stage"


def test_freeze_a_draft_and_refuse_it_after_an_edit(tmp_path, capsys):
    draft = json.loads(load_policy("two-stage").canonical_json())
    draft["name"] = "my-teacher"
    draft["weights"]["ambiguous"] = 0.3
    (tmp_path / "draft.json").write_text(json.dumps(draft))
    frozen = tmp_path / "my-teacher.json"
    assert main(["judge", "--freeze", str(tmp_path / "draft.json"), "--out", str(frozen)]) == 0
    policy = load_policy(frozen)
    assert policy.weights.ambiguous == 0.3 and policy.name == "my-teacher"
    edited = json.loads(frozen.read_text())
    edited["policy"]["weights"]["ambiguous"] = 0.5
    frozen.write_text(json.dumps(edited))
    with FaultyChatServer(Fault.OK) as server:
        code = main(["judge", str(tmp_path / "none.jsonl"), "--policy", str(frozen), "--base-url", server.base_url])
    assert code == 2 and "was edited" in capsys.readouterr().err


def test_judge_a_dump_writes_verdicts_and_a_summary(dump, tmp_path, capfd, caplog, recwarn, monkeypatch):
    capture_command_log(caplog, monkeypatch)
    out, summary = tmp_path / "v.jsonl", tmp_path / "s.json"
    with FaultyChatServer(Fault.OK) as server:
        args = ["judge", str(dump), "--base-url", server.base_url, "--out", str(out), "--summary", str(summary),
                "--cache", str(tmp_path / "c.sqlite")]
        assert main(args) == 0
        assert main(args) == 0  # second run: all from the cache
        calls = server.calls
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 5 and all(from_dict(Verdict, r["verdict"]).status is not None for r in rows)
    report = json.loads(summary.read_text())
    assert report["total"]["cache_hits"] == report["total"]["requests"] == 10 and calls == 10
    assert report["stage_a_status"]["S"] == 5 and report["stage_b_run_rate"] == 1.0
    # the fake server's refined answer is not in the evidence: the grounding rule lowers every verdict to I
    assert report["status"]["I"] == 5 and report["ungrounded"] == 5
    captured = assert_clean_in_process(capfd, caplog, recwarn)  # its log: eviback's lines only
    assert "cache hits 10/10" in captured.out


def test_a_dead_server_fails_every_rollout_and_the_command_says_so(dump, tmp_path, capsys):
    with FaultyChatServer(Fault.ERROR_500) as server:
        code = main(["judge", str(dump), "--base-url", server.base_url, "--no-cache", "--max-attempts", "2",
                     "--backoff", "0", "--out", str(tmp_path / "v.jsonl")])
    assert code == 1  # the run finished; every verdict is a teacher_error
    rows = [json.loads(line) for line in (tmp_path / "v.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and all(r["verdict"]["error"] and r["verdict"]["reward"] is None for r in rows)
    assert "errors 5" in capsys.readouterr().out


def test_a_malformed_dump_names_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": {"id": "x"}}\n')
    with FaultyChatServer(Fault.OK) as server:
        assert main(["judge", str(bad), "--base-url", server.base_url]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err


def test_judge_writes_the_evidence_label_beside_each_verdict(dump, tmp_path, capsys):
    from eviback.teacher.judge import read_trajectories
    from eviback.teacher.labels import trajectory_label

    out, summary = tmp_path / "v.jsonl", tmp_path / "s.json"
    with FaultyChatServer(Fault.OK) as server:
        assert main(["judge", str(dump), "--base-url", server.base_url, "--out", str(out), "--summary",
                     str(summary), "--no-cache", "--labels"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    expected = [trajectory_label(t).value for t in read_trajectories(dump)]
    assert [r["label"] for r in rows] == expected
    agreement = json.loads(summary.read_text())["stage_a_agreement"]
    assert agreement["n"] == 5 and sum(agreement["confusion"][k]["S"] for k in "SAI") == 5  # Stage A said S
    assert "stage A vs label on 5" in capsys.readouterr().out
