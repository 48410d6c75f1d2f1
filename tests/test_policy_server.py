"""The policy-server backend (`backend=vllm-server`, generation/server.py) against a scripted fake of vLLM's
OpenAI-compatible server (httpx's mock transport): what each request carries, how replies become Completions,
and every refusal. A real `vllm serve` of the bundled model is in tests/test_policy_server_e2e.py."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from eviback.evaluate import EvalConfig
from eviback.generation import BackendConfig, EngineSettings, FinishReason, SamplingConfig
from eviback.generation.server import (
    LOGPROBS_MODE,
    PROBE,
    ServerConfig,
    ServerError,
    ServerInfo,
    VllmServerBackend,
    request_seed,
    serve_command,
)
from eviback.policy import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


class FakeServer:
    """vLLM's server as far as this backend reads it; `complete(body)` scripts each completion."""

    def __init__(self, tokenizer, *, dev_mode: bool = True, logprobs_mode: str = LOGPROBS_MODE,
                 weight_transfer: bool = True, tokenize=None, complete=None) -> None:
        self.tokenizer = tokenizer
        self.dev_mode = dev_mode
        self.logprobs_mode = logprobs_mode
        self.weight_transfer = weight_transfer
        self.tokenize = tokenize or (lambda text: tokenizer.encode(text, add_special_tokens=False))
        self.complete = complete or self.echo
        self.bodies: list[dict[str, Any]] = []

    @staticmethod
    def echo(body: dict[str, Any]) -> dict[str, Any]:
        """Three tokens of the prompt back, the last completing no stop string: a length stop."""
        ids = body["prompt"][:3]
        return {"token_ids": ids, "finish_reason": "length", "stop_reason": None,
                "logprobs": {"token_logprobs": [-0.5] * len(ids)}}

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "policy", "root": "/models/policy", "max_model_len": 4096}]})
        if path == "/server_info":
            if not self.dev_mode:
                return httpx.Response(404, json={"detail": "Not Found"})
            transfer = {"backend": "nccl"} if self.weight_transfer else None
            return httpx.Response(200, json={"vllm_config": {
                "model_config": {"logprobs_mode": self.logprobs_mode, "dtype": "torch.bfloat16"},
                "weight_transfer_config": transfer}})
        if path == "/tokenize":
            body = json.loads(request.content)
            return httpx.Response(200, json={"tokens": self.tokenize(body["prompt"])})
        if path == "/v1/completions":
            body = json.loads(request.content)
            self.bodies.append(body)
            choice = self.complete(body)
            if isinstance(choice, httpx.Response):
                return choice
            return httpx.Response(200, json={"choices": [{"index": 0, "text": "", **choice}],
                                             "usage": {"prompt_tokens_details": {"cached_tokens": 128}}})
        return httpx.Response(404, json={"detail": "Not Found"})

    def backend(self, **config: Any) -> VllmServerBackend:
        return VllmServerBackend(self.tokenizer, ServerConfig(**config), transport=httpx.MockTransport(self.handle))


def test_each_prompt_is_one_request_of_token_ids_with_the_rollouts_settings(tokenizer):
    server = FakeServer(tokenizer)
    backend = server.backend()
    params = SamplingConfig(max_tokens=64, temperature=0.7, top_p=0.9)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    out = backend.generate(prompts, params, max_tokens=[10, 5000])
    assert [o.token_ids for o in out] == [(1, 2, 3), (5, 6, 7)]  # in order
    assert all(o.finish_reason is FinishReason.LENGTH and o.logprobs == (-0.5,) * 3 for o in out)
    assert all(o.cached_prompt_tokens == 128 for o in out)
    first, second = sorted(server.bodies, key=lambda b: len(b["prompt"]), reverse=True)
    assert first["prompt"] == [1, 2, 3, 4] and first["max_tokens"] == 10
    assert second["max_tokens"] == 4096 - 3  # a cap past the context is cut to what fits
    for body in server.bodies:
        assert body["model"] == "policy" and body["return_token_ids"] is True
        assert body["temperature"] == 0.7 and body["top_p"] == 0.9 and body["logprobs"] == 0
        assert body["stop"] == list(params.stop) and body["include_stop_str_in_output"] is True
        # nothing left for the server to fill from the model's generation_config.json (Qwen3: top_k=20)
        assert body["top_k"] == 0 and body["min_p"] == 0.0 and body["repetition_penalty"] == 1.0
        assert body["presence_penalty"] == 0.0 and body["frequency_penalty"] == 0.0
        assert "seed" not in body  # unseeded by default: vLLM samples seeded rows one at a time
    assert backend.max_context == 4096 and backend.info.dtype == "bfloat16"


def test_seeded_rows_get_their_own_seeds_and_reseed_repeats_them(tokenizer):
    """With `seeded`, each row gets its own seed (a batched request's one seed would give a group's identical
    prompts identical samples), and reseed makes the next calls send the same seeds again."""
    server = FakeServer(tokenizer)
    backend = server.backend(seeded=True)
    group = [[1, 2, 3]] * 5
    backend.reseed(7)
    backend.generate(group, SamplingConfig(max_tokens=8))
    backend.generate(group, SamplingConfig(max_tokens=8))
    first = [b["seed"] for b in server.bodies]
    assert len(set(first)) == 10  # distinct within a call and across calls
    server.bodies.clear()
    backend.reseed(7)
    backend.generate(group, SamplingConfig(max_tokens=8))
    backend.generate(group, SamplingConfig(max_tokens=8))
    assert sorted(b["seed"] for b in server.bodies) == sorted(first)
    assert request_seed(7, 0, 0) == request_seed(7, 0, 0) != request_seed(8, 0, 0)
    assert all(0 <= s < 2 ** 63 for s in first)


def test_stop_string_eos_and_the_text_decoded_from_the_ids(tokenizer):
    search = tokenizer.encode(" <search> capital of France</search>", add_special_tokens=False)
    answers = iter([
        {"token_ids": search, "finish_reason": "stop", "stop_reason": "</search>",
         "logprobs": {"token_logprobs": [-1.0] * len(search)}, "text": "cut by the server"},
        {"token_ids": [tokenizer.eos_token_id], "finish_reason": "stop", "stop_reason": None,
         "logprobs": {"token_logprobs": [-0.1]}},
    ])
    server = FakeServer(tokenizer, complete=lambda body: next(answers))
    stop, eos = server.backend().generate([[1], [1]], SamplingConfig(max_tokens=32))
    assert stop.finish_reason is FinishReason.STOP and stop.text.endswith("</search>")
    assert stop.token_ids == tuple(search) and stop.text == tokenizer.decode(search, skip_special_tokens=True)
    assert eos.finish_reason is FinishReason.EOS and eos.token_ids == (tokenizer.eos_token_id,)


def test_missing_log_probabilities_and_an_unknown_finish_are_refused(tokenizer):
    short = FakeServer(tokenizer, complete=lambda body: {"token_ids": [1, 2], "finish_reason": "length",
                                                        "logprobs": {"token_logprobs": [-1.0]}})
    with pytest.raises(ServerError, match="1 log-probabilities for 2 tokens"):
        short.backend().generate([[1]], SamplingConfig(max_tokens=2))
    aborted = FakeServer(tokenizer, complete=lambda body: {"token_ids": [1], "finish_reason": "abort"})
    with pytest.raises(ServerError, match="finish_reason='abort'"):
        aborted.backend().generate([[1]], SamplingConfig(max_tokens=2, logprobs=False))


def test_bad_requests_say_what_the_server_said(tokenizer):
    refuse = FakeServer(tokenizer, complete=lambda body: httpx.Response(400, json={"message": "prompt too long"}))
    with pytest.raises(ValueError, match="refused /v1/completions \\(400\\).*prompt too long"):
        refuse.backend().generate([[1]], SamplingConfig(max_tokens=2))
    with pytest.raises(ValueError, match="does not fit the server's max_model_len=4096"):
        FakeServer(tokenizer).backend().generate([[1] * 4096], SamplingConfig(max_tokens=2))


def test_a_server_whose_tokenizer_differs_is_refused(tokenizer):
    other = FakeServer(tokenizer, tokenize=lambda text: [1, 2, 3])
    with pytest.raises(ValueError, match="tokenizer gives other ids"):
        other.backend()
    assert "<information>" in PROBE and "</search>" in PROBE


def test_no_server_names_the_url_and_how_to_start_one(tokenizer):
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Connection refused", request=request)

    with pytest.raises(ServerError, match="no policy server answers at http://localhost:8002.*eviback serve-policy"):
        VllmServerBackend(tokenizer, ServerConfig(), transport=httpx.MockTransport(down))


@pytest.mark.parametrize(("server", "problem"), [
    ({"dev_mode": False}, "without VLLM_SERVER_DEV_MODE=1"),
    ({"weight_transfer": False}, "no weight-transfer engine"),
    ({"logprobs_mode": "raw_logprobs"}, "'raw_logprobs', not 'processed_logprobs'"),
])
def test_a_server_that_cannot_take_a_weight_push_is_refused_for_training(tokenizer, server, problem):
    backend = FakeServer(tokenizer, **server).backend()
    backend.generate([[1, 2, 3]], SamplingConfig(max_tokens=4))  # generation (evaluation) works
    with pytest.raises(ServerError, match=problem) as refusal:
        backend.check_training()
    assert "eviback serve-policy" in str(refusal.value)


def test_the_weight_push_needs_the_trainer_on_a_gpu(tokenizer):
    import torch

    backend = FakeServer(tokenizer).backend()
    backend.check_training()  # this server could take one
    with pytest.raises(ServerError, match="needs the trainer's weights on a CUDA GPU; they are on cpu"):
        backend.update_weights({"lm_head.weight": torch.zeros(2, 2)})


def test_settings_are_checked_before_any_connection():
    with pytest.raises(ValueError, match="http\\(s\\) URL"):
        BackendConfig(backend="vllm-server", engine=EngineSettings(policy_url="localhost:8002"))
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        EngineSettings(policy_timeout_s=0)
    with pytest.raises(ValueError, match="concurrency"):
        ServerConfig(concurrency=0)


def test_server_info_reads_what_vllm_reports():
    models = {"data": [{"id": "m", "root": "/d", "max_model_len": 2048}]}
    bare = ServerInfo.parse(models, None)
    assert not bare.dev_mode and bare.training_problems()
    full = ServerInfo.parse(models, {"vllm_config": {"model_config": {"logprobs_mode": LOGPROBS_MODE,
                                                                      "dtype": "torch.float32"},
                                                     "weight_transfer_config": {"backend": "nccl"}}})
    assert full.training_problems() == [] and full.dtype == "float32" and full.weight_transfer == "nccl"


def test_the_serve_command_has_the_flags_trl_sets():
    command = serve_command("/m", port=8010)
    assert command[:3] == ["vllm", "serve", "/m"] and "8010" in command
    assert command[command.index("--logprobs-mode") + 1] == LOGPROBS_MODE
    assert json.loads(command[command.index("--weight-transfer-config") + 1]) == {"backend": "nccl"}
    assert "--weight-transfer-config" not in serve_command("/m", training=False)


def test_serve_policy_listens_on_this_machine_unless_told(capsys):
    """A training server runs vLLM's development endpoints, which replace the served weights: by default only
    this machine reaches them; another address is allowed, with a warning."""
    from eviback.cli import main

    assert main(["serve-policy", "--print"]) == 0
    out, err = capsys.readouterr()
    assert out.split().count("--host") == 1 and out.split()[out.split().index("--host") + 1] == "127.0.0.1"
    assert not err
    assert main(["serve-policy", "--print", "--host", "0.0.0.0"]) == 0
    assert "replace the served weights" in capsys.readouterr().err
    assert main(["serve-policy", "--print", "--host", "0.0.0.0", "--generation-only"]) == 0
    assert not capsys.readouterr().err  # no weight-push endpoints


@pytest.mark.parametrize(("settings", "words"), [
    (["backend=vllm-server", "device=cpu"], ["backend=vllm-server", "CUDA GPU", "on cpu", "backend=vllm"]),
    (["backend=vllm-server", "policy_url=localhost:8002"], ["policy_url", "http(s) URL"]),
    (["backend=tgi"], ["backend must be one of vllm, hf, vllm-server"]),
])
def test_eviback_train_refuses_a_server_it_cannot_use_before_any_work(settings, words, tmp_path, capsys):
    from eviback.cli import main

    output = tmp_path / "run"
    code = main(["train", "--preset", "demo", *[a for s in settings for a in ("--set", s)], "--output", str(output)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert all(word in err for word in words), err
    assert not output.exists()


def test_eviback_eval_refuses_a_dead_server_in_one_line(tmp_path, capsys):
    from eviback.cli import main

    code = main(["eval", "--backend", "vllm-server", "--policy-url", "http://127.0.0.1:9", "--benchmarks", "nq",
                 "--limit", "1", "--out", str(tmp_path / "eval")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "no policy server answers at http://127.0.0.1:9" in err and "eviback serve-policy" in err


# ---- a server that stops answering in the middle of the work


def test_a_server_that_stops_answering_mid_run_is_unavailable_not_retried(tokenizer):
    """A refused connection, a timeout or a 502-504 after the start is PolicyServerUnavailable (exit 75, found
    through wrapping errors): not retried, since a restarted server holds other weights than the last push."""
    from eviback.generation.server import PolicyServerUnavailable
    from eviback.unavailable import ServiceUnavailable

    state = {"up": True}

    def complete(body):
        if not state["up"]:
            raise httpx.ConnectError("Connection refused")
        return FakeServer.echo(body)

    server = FakeServer(tokenizer, complete=complete)
    backend = server.backend()
    backend.generate([[1, 2, 3]], SamplingConfig(max_tokens=4))
    state["up"] = False
    with pytest.raises(PolicyServerUnavailable) as down:
        backend.generate([[1, 2, 3]], SamplingConfig(max_tokens=4))
    assert len(server.bodies) == 2  # one attempt, no retry
    error = down.value
    assert error.exit_code == 75 and error.url == "http://localhost:8002"
    assert error.describe() == "the policy server at http://localhost:8002 stopped answering (last error: " \
                               "ConnectError: Connection refused)"
    try:
        raise RuntimeError("rollout failed") from error
    except RuntimeError as wrapped:
        assert ServiceUnavailable.found_in(wrapped) is error
    unavailable = FakeServer(tokenizer, complete=lambda body: httpx.Response(503, text="shutting down"))
    with pytest.raises(PolicyServerUnavailable, match="HTTP 503 from /v1/completions"):
        unavailable.backend().generate([[1]], SamplingConfig(max_tokens=2))


def test_a_server_down_at_the_start_is_a_refusal_not_a_stopped_run(tokenizer):
    """Before any work a dead server is a settings error (exit 2), which --resume would not mend: the
    unavailable error under it is hidden from the commands' search."""
    from eviback.unavailable import ServiceUnavailable

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Connection refused", request=request)

    with pytest.raises(ServerError) as refused:
        VllmServerBackend(tokenizer, ServerConfig(), transport=httpx.MockTransport(down))
    assert ServiceUnavailable.found_in(refused.value) is None


def test_eviback_train_stopped_by_its_policy_server_says_how_to_resume(tmp_path, capsys, monkeypatch):
    """The paragraph and exit status of a training run whose policy server stopped answering in step 4 (the
    run itself needs a GPU: its stop is raised where `run_training` would raise it)."""
    from eviback.cli import main
    from eviback.commands import train as command
    from eviback.generation.server import PolicyServerUnavailable
    from run_fakes import stopped_run_dir

    output = tmp_path / "run"

    def stopped(config, out, *, resume=False):
        stopped_run_dir(output, logged=3, checkpoint=2)
        try:
            raise PolicyServerUnavailable("http://gpu7:8002", "RemoteProtocolError: Server disconnected")
        except PolicyServerUnavailable as e:
            raise RuntimeError("TRL's step failed") from e

    monkeypatch.setattr(command, "run_training", stopped)
    code = main(["train", "--preset", "grpo", "--set", "backend=vllm-server", "--set", "policy_url=http://gpu7:8002",
                 "--set", "save_steps=2", "--output", str(output)])
    err = capsys.readouterr().err
    assert code == 75 and "Traceback" not in err, err
    assert err.startswith("eviback train: the policy server at http://gpu7:8002 stopped answering (last error: "
                          "RemoteProtocolError: Server disconnected), so the run stopped in step 4 of ")
    assert "steps 3-4 are redone" in err and "`eviback serve-policy` serving at http://gpu7:8002" in err
    assert f"--output {output} --resume`, which pushes the run's weights into the restarted server" in err
    assert "policy_timeout_s=SECONDS` (now 600)" in err


def test_a_stopped_process_of_a_launch_leaves_at_once(tmp_path, capsys, monkeypatch):
    """Under a launcher the other processes may wait in a collective this one will never join: the stopped
    process says its paragraph, then exits at once with its code (no interpreter shutdown, which would tear
    down the process group and, with NCCL, wait on the others), so that the launcher stops the rest."""
    from eviback.cli import main
    from eviback.commands import train as command
    from eviback.retrieval.client import RetrieverUnavailable

    def stopped(config, out, *, resume=False):
        raise RetrieverUnavailable("http://search:8000", "ConnectError", 9, 300.0)

    exits = []

    def leave(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(command, "run_training", stopped)
    monkeypatch.setattr(command.os, "_exit", leave)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        main(["train", "--preset", "grpo", "--output", str(tmp_path / "run")])
    assert exits == [75] and "eviback train: " in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["train", "--preset", "grpo", "--output", str(tmp_path / "run")]) == 75 and exits == [75]


class _DyingServer:
    """A real HTTP server in a thread, answering as `FakeServer` does until `completions` completions were
    served; from then on it drops each completion request unanswered (a server that crashed mid-request)."""

    def __init__(self, fake: FakeServer, completions: int) -> None:
        import http.server
        import threading

        owner = self
        self.fake, self.left = fake, completions

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _serve(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path.startswith("/v1/completions"):
                    with lock:
                        owner.left -= 1
                        dead = owner.left < 0
                    if dead:
                        self.close_connection = True
                        return
                reply = owner.fake.handle(httpx.Request(self.command, f"http://x{self.path}", content=body))
                self.send_response(reply.status_code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply.content)))
                self.end_headers()
                self.wfile.write(reply.content)

            do_GET = do_POST = _serve

        lock = threading.Lock()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_eviback_eval_stopped_by_its_policy_server_keeps_the_answers_and_resumes(tokenizer, tmp_path, capsys):
    """Over real HTTP: the server answers the first batch's questions, then drops requests. The evaluation stops
    with exit 75 and the paragraph, keeping the answered questions; the same command against a live server
    evaluates the rest only."""
    from eviback.cli import main

    answer = tokenizer.encode("<answer> Paris </answer>", add_special_tokens=False) + [tokenizer.eos_token_id]

    def answers(body):
        return {"token_ids": answer, "finish_reason": "stop", "stop_reason": None,
                "logprobs": {"token_logprobs": [-0.1] * len(answer)}}

    out = tmp_path / "eval"
    dying = _DyingServer(FakeServer(tokenizer, complete=answers), completions=2)
    command = ["eval", "--backend", "vllm-server", "--benchmarks", "nq", "--limit", "4", "--batch-size", "2",
               "--out", str(out), "--no-progress"]
    try:
        code = main([*command, "--policy-url", dying.url, "--policy-timeout-s", "30"])
    finally:
        dying.close()
    err = capsys.readouterr().err
    assert code == 75 and "Traceback" not in err, err[-3000:]
    assert f"eviback eval: the policy server at {dying.url} stopped answering (last error: RemoteProtocolError" in err
    assert "once the policy server answers again (`eviback serve-policy` serving at" in err
    assert "(--policy-timeout-s waits longer for a server that is only slow, now 30 s)" in err
    items = list((out).rglob("items.jsonl"))
    assert len(items) == 1 and len(items[0].read_text().splitlines()) == 2
    live = _DyingServer(FakeServer(tokenizer, complete=answers), completions=100)
    try:
        assert main([*command, "--policy-url", live.url]) == 0
        assert live.left == 100 - 2  # only the two questions left
    finally:
        live.close()
    assert len(items[0].read_text().splitlines()) == 4


def test_eval_hands_its_timeout_to_the_server_client(monkeypatch):
    import eviback.evaluate as evaluate

    seen = []
    monkeypatch.setattr(evaluate, "load_backend", lambda config: seen.append(config) or object())
    engine = EngineSettings(policy_url="http://gpu7:8002", policy_timeout_s=42)
    evaluate._load_backend(EvalConfig(backend="vllm-server", engine=engine))
    assert seen[0].engine.server_config() == ServerConfig(url="http://gpu7:8002", timeout_s=42)


def test_a_shared_engine_is_pushed_by_the_main_process_alone_and_the_others_wait():
    """`push_weights`, as the runner (the starting policy) and the trainer (after each step) call it: a policy
    server serves every process, so only the main one pushes; every process waits at the barrier. A process's
    own engine is pushed by each process."""
    import torch

    from eviback.generation.base import push_weights

    class Engine:
        def __init__(self, shared: bool) -> None:
            self.shared, self.pushes = shared, []

        def update_weights(self, weights) -> None:
            self.pushes.append(dict(weights))

    class Processes:
        def __init__(self, main: bool) -> None:
            self.is_main_process, self.waits = main, 0

        def wait_for_everyone(self) -> None:
            self.waits += 1

    model = torch.nn.Linear(2, 2)
    for main, pushes in ((True, 1), (False, 0)):
        engine, processes = Engine(shared=True), Processes(main)
        push_weights(engine, model, processes)
        assert len(engine.pushes) == pushes and processes.waits == 1
    engine, processes = Engine(shared=False), Processes(main=False)
    push_weights(engine, model, processes)
    assert list(engine.pushes[0]) == ["weight", "bias"] and processes.waits == 0
