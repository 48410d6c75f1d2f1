"""`backend=vllm-server` against a real `vllm serve` of the bundled SmolLM2 on the CPU, started as a user starts
it (`eviback serve-policy --generation-only`: vLLM's CPU build has no NCCL weight transfer): the backend's
contract (ids, stop strings cut where decoding says, log-probabilities, seeds), the refusal of a server a
training run cannot push into, and `eviback eval --backend vllm-server` end to end."""

from __future__ import annotations

import json
import os
import sys

import pytest

from eviback.generation import SamplingConfig
from eviback.generation.base import FinishReason, stop_cut
from eviback.generation.server import ServerConfig, ServerError, VllmServerBackend
from eviback.protocol import apply_chat_template
from eviback.vllm_process import ServerProcess
from test_retrieval_service import free_port

pytestmark = pytest.mark.slow  # a real vLLM server: about a minute to start on 2 cores

pytest.importorskip("vllm")


# The sampling defaults of a Qwen3 checkpoint's generation_config.json, and more: vLLM's server fills every field
# a request leaves out from them.
SHIPPED_DEFAULTS = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.1,
                    "repetition_penalty": 1.3}


def model_with_shipped_defaults(directory) -> str:
    """The bundled policy's checkpoint (its files linked) with SHIPPED_DEFAULTS in its generation config."""
    from eviback.policy import DEFAULT_MODEL, resolve_model

    source = resolve_model(DEFAULT_MODEL)
    for path in os.listdir(source):
        if path != "generation_config.json":
            os.symlink(os.path.join(source, path), directory / path)
    shipped = {}
    if os.path.exists(os.path.join(source, "generation_config.json")):
        with open(os.path.join(source, "generation_config.json")) as f:
            shipped = json.load(f)
    (directory / "generation_config.json").write_text(json.dumps({**shipped, **SHIPPED_DEFAULTS}))
    return str(directory)


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("policy-server") / "server.log"
    model = model_with_shipped_defaults(tmp_path_factory.mktemp("policy"))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "eviback.cli", "serve-policy", model, "--host", "127.0.0.1", "--port",
            str(port), "--generation-only", "--vllm-args", "--max-model-len 2048 --max-num-seqs 16 -O0"]
    with ServerProcess(argv, f"http://127.0.0.1:{port}", env=env, log_path=log, name="eviback serve-policy") as server:
        # the command it runs, printed before the server's own lines
        assert any(line.startswith("VLLM_SERVER_DEV_MODE=1 vllm serve ") for line in log.read_text().splitlines())
        yield server.url


@pytest.fixture(scope="module")
def backend(server_url):
    backend = VllmServerBackend.connect("smollm2-135m", ServerConfig(url=server_url, concurrency=16))
    yield backend
    backend.close()


def _prompt(backend, question: str = "Who wrote the play Hamlet?") -> list[int]:
    return backend.tokenizer(apply_chat_template(backend.tokenizer, question), add_special_tokens=False)["input_ids"]


def test_the_server_answers_what_the_backend_checks(backend):
    assert backend.info.dev_mode and backend.info.weight_transfer is None
    assert backend.max_context == 2048
    with pytest.raises(ServerError, match="no weight-transfer engine"):  # --generation-only: not for training
        backend.check_training()


def test_a_stop_string_cuts_where_decoding_the_ids_says(backend):
    """Greedy, one prompt per call (nothing else in the batch): the free continuation, then the same with a
    stop string taken from its middle, which must end right where decoding the ids first contains it."""
    prompt = _prompt(backend)
    free, = backend.generate([prompt], SamplingConfig(max_tokens=40, temperature=0, stop=()))
    assert free.finish_reason in (FinishReason.LENGTH, FinishReason.EOS) and len(free.token_ids) > 12
    assert len(free.logprobs) == len(free.token_ids) and all(lp <= 0 for lp in free.logprobs)
    middle = backend.tokenizer.decode(free.token_ids[6:10], skip_special_tokens=True).strip()
    assert middle
    stopped, = backend.generate([prompt], SamplingConfig(max_tokens=40, temperature=0, stop=(middle,)))
    assert stopped.finish_reason is FinishReason.STOP and middle in stopped.text
    cut = stop_cut(backend.tokenizer, free.token_ids, (middle,))
    assert stopped.token_ids == free.token_ids[:cut]  # the ids as sampled, up to the token completing the stop


def test_a_group_samples_apart_and_a_seeded_backend_repeats_a_call(backend, server_url):
    prompt = _prompt(backend)
    params = SamplingConfig(max_tokens=24, temperature=1.0)
    group = backend.generate([prompt] * 4, params)
    assert len({o.token_ids for o in group}) > 1  # a group of identical prompts is not one sample four times
    seeded = VllmServerBackend.connect("smollm2-135m", ServerConfig(url=server_url, concurrency=16, seeded=True))
    try:
        seeded.reseed(3)
        group = seeded.generate([prompt] * 4, params)
        assert len({o.token_ids for o in group}) > 1  # each row its own seed
        seeded.reseed(11)
        first, = seeded.generate([prompt], params)
        seeded.reseed(11)
        again, = seeded.generate([prompt], params)
        assert again.token_ids == first.token_ids and again.logprobs == pytest.approx(first.logprobs, abs=1e-4)
    finally:
        seeded.close()


def test_the_served_models_sampling_defaults_do_not_truncate_the_rollouts(backend):
    """The served model ships top_k=20, top_p=0.95, min_p and a repetition penalty: a rollout is still sampled
    from the whole distribution at the rollout's temperature (more than 20, and 50, distinct next tokens of an
    uncertain prompt), and its log-probabilities are not those of a truncated, renormalised distribution."""
    prompt = backend.tokenizer.encode("My favourite word in the whole English language is", add_special_tokens=False)
    out = backend.generate([prompt] * 300, SamplingConfig(max_tokens=1, temperature=1.0, stop=()))
    assert len({o.token_ids[0] for o in out}) > 50
    assert min(o.logprobs[0] for o in out) < -6  # tokens a top-20 cut would never sample


def test_eval_runs_through_the_server(server_url, tmp_path, capsys):
    from eviback.cli import main

    out = tmp_path / "eval"
    code = main(["eval", "--backend", "vllm-server", "--policy-url", server_url, "--benchmarks", "nq", "--limit", "3",
                 "--max-turns", "2", "--max-turn-tokens", "48", "--max-context-tokens", "1536", "--out", str(out),
                 "--no-progress"])
    assert code == 0, capsys.readouterr().err[-3000:]
    items = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines()]
    assert len(items) == 3
    summary = json.loads((out / "summary.json").read_text())
    assert summary and (out / "viewer.html").exists()
