"""A training run whose `/retrieve` service goes away, as a user meets it: `eviback train` in a subprocess
against a real `eviback serve` (BM25 over the embedded corpus) that is stopped mid-run. Restarted after a
few seconds on the same port, the run waits for it and finishes; never restarted, the run stops past its
`retrieval_deadline_s` with one paragraph (no traceback) whose `--resume` command, run once the service is
back, finishes the run.

The policy is a tiny model that always searches (SmolLM2 without a warm start never does, and a warm start
costs minutes): everything else is the path a user runs."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from eviback.train.run import read_records
from test_retrieval_service import Server, free_port, wait_until

pytestmark = pytest.mark.slow  # real training runs and a real server

SEARCH = "<search> hamlet </search>"

# As small as a real run gets: 2 questions x 2 rollouts per step, one executed search each, a checkpoint a step.
TINY = {
    "backend": "hf",
    "warm_start": False,
    "group_size": 2,
    "questions_per_step": 2,
    "max_turns": 1,
    "max_turn_tokens": 16,
    "max_obs_tokens": 64,
    "save_steps": 1,
    "train_files": ["popqa_train"],
}


@pytest.fixture(scope="module")
def searching_policy(tmp_path_factory) -> Path:
    """A one-layer Llama with SmolLM2's tokenizer whose next token depends on the current token only, chained
    so that it answers every prompt (whose chat template ends in a newline) with `<search> hamlet </search>`:
    attention and MLP write nothing, each chain token's embedding is its own axis, and the LM head maps that
    axis to the next token of the chain (every other token to the chain's first). Built, not trained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eviback.policy import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m", "float32")
    chain = tokenizer(SEARCH, add_special_tokens=False)["input_ids"]
    follows = dict(zip(chain, chain[1:], strict=False))  # `>` is followed by `hamlet` once: the stop string ends it
    sources = sorted(follows)
    hidden = len(sources) + 1  # one axis per chain token, one shared by every other token
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=hidden,
                         max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.model.layers[0].input_layernorm.weight.fill_(1.0)
        model.model.layers[0].post_attention_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed[:, hidden - 1] = 1.0
        head[chain[0], hidden - 1] = 10.0  # any other token: start the search
        for axis, token in enumerate(sources):
            embed[token] = 0.0
            embed[token, axis] = 1.0
            head[follows[token], axis] = 10.0  # a logit margin of about 26 after the norm: near-certain at T=1
    path = tmp_path_factory.mktemp("searching-policy")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def index() -> Path:
    """The embedded corpus's BM25 index (what `eviback serve` serves without an index argument)."""
    from eviback.retrieval import suite_retriever
    from eviback.retrieval.index import suite_index_dir

    suite_retriever().close()  # built once into the cache
    return suite_index_dir()[0]


class Training:
    """`eviback train --preset grpo` on TINY in a subprocess, its output (stdout and stderr) read as it comes."""

    def __init__(self, tmp_path: Path, name: str, steps: int, *settings: str, command: list[str] | None = None):
        self.root = tmp_path / name
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump({**TINY, "max_steps": steps}))
        self.command = command or [sys.executable, "-m", "eviback.cli", "train", "--preset", "grpo", "--config",
                                   str(config), *[a for s in settings for a in ("--set", s)], "--output", str(self.root)]
        env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def steps_logged(self) -> list[int]:
        return [m["step"] for m in read_records(self.root / "metrics.jsonl")]

    def metrics(self) -> list[dict]:
        return read_records(self.root / "metrics.jsonl")

    def wait_for_step(self, step: int) -> None:
        wait_until(lambda: step in self.steps_logged() or self.process.poll() is not None, f"step {step} logged",
                   timeout_s=600)
        assert step in self.steps_logged(), f"the run ended before step {step}:\n{self.output[-3000:]}"

    def finish(self, timeout_s: float = 900) -> int:
        code = self.process.wait(timeout=timeout_s)
        self._reader.join(timeout=30)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def test_a_training_run_outlives_a_retriever_restart(tmp_path, searching_policy, index):
    server = Server(index, free_port()).start()
    run = Training(tmp_path, "restart", 3, f"retriever={server.url}", f"model={searching_policy}")
    try:
        run.wait_for_step(1)
        server.stop()  # restarted as a user restarts a service: stopped, then started again on the same port
        wait_until(lambda: "retrieval attempt" in run.output or run.process.poll() is not None,
                   "the run meeting the stopped service", timeout_s=600)
        assert run.process.poll() is None, run.output[-3000:]
        time.sleep(3)  # down for a few seconds: several attempts fail
        server.start()
        assert run.finish() == 0, run.output[-3000:]
    finally:
        run.kill()
        server.stop()
    assert run.steps_logged() == [1, 2, 3]  # nothing lost, nothing logged twice
    assert all(m["rollout/avg_searches"] > 0 for m in run.metrics())  # every step searched through the service
    retries = [line for line in run.lines if "retrieval attempt" in line]
    assert len(retries) >= 2  # each attempt logged, with the service, the error and the time left
    assert all(server.url in line and "left of the 300 s deadline" in line for line in retries)
    assert "ConnectError" in retries[0]


def test_a_run_whose_retriever_stays_down_stops_with_the_command_that_resumes_it(tmp_path, searching_policy, index):
    server = Server(index, free_port()).start()
    run = Training(tmp_path, "down", 3, f"retriever={server.url}", f"model={searching_policy}",
                   "retrieval_deadline_s=2")
    try:
        run.wait_for_step(1)
        server.stop()  # and not restarted until the run has given up
        code = run.finish()
    finally:
        run.kill()
        server.stop()
    output = run.output
    assert code == 75, output[-3000:]  # EX_TEMPFAIL: try again later
    assert "Traceback" not in output
    # Stopped after step 1 was logged, the service was gone by step 2's searches or, at the latest, step 3's;
    # the step in progress when the deadline passed is not logged.
    done = len(run.steps_logged())
    assert run.steps_logged() == list(range(1, done + 1)) and done in (1, 2)
    paragraph = next(line for line in output.splitlines() if line.startswith("eviback train: the retrieval service"))
    assert f"the retrieval service at {server.url} did not answer for 2 s" in paragraph
    assert "last error: ConnectError" in paragraph
    assert f"stopped in step {done + 1} of 3" in paragraph
    assert f"continues from its checkpoint at step {done}: only step {done + 1} is redone" in paragraph  # save_steps=1
    command = re.search(r"continue the run with `([^`]+)`", paragraph).group(1)
    words = shlex.split(command)
    assert words[:2] == ["eviback", "train"] and words[-1] == "--resume"
    assert f"retriever={server.url}" in words and str(run.root) in words
    assert "retrieval_deadline_s" in paragraph  # the setting that waits longer

    # The service back, the printed command (with the interpreter running eviback) finishes the run.
    server.start()
    resumed = Training(tmp_path, "down", 3, command=[sys.executable, "-m", "eviback.cli", *words[1:]])
    try:
        assert resumed.finish() == 0, resumed.output[-3000:]
    finally:
        resumed.kill()
        server.stop()
    assert "resuming" in resumed.output
    assert resumed.steps_logged() == [1, 2, 3]


def test_an_evaluation_whose_retriever_is_down_stops_with_a_paragraph(tmp_path, searching_policy, capsys):
    from eviback.cli import main

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code = main(["eval", "--benchmarks", "nq", "--limit", "2", "--model", str(searching_policy), "--backend", "hf",
                 "--retriever", url, "--retrieval-deadline-s", "1", "--out", str(tmp_path / "eval"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 75, err[-3000:]
    assert "Traceback" not in err
    assert f"eviback eval: the retrieval service at {url} did not answer for 1 s" in err
    assert "last error: ConnectError" in err and "rerun the same command" in err


def test_a_warm_start_whose_retriever_is_down_stops_with_the_same_paragraph(tmp_path):
    """The warm start builds its examples by searching, in a process of its own: a service that is down there
    stops the run with the same paragraph as in a step (no traceback from either process), before any step."""
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    run = Training(tmp_path, "warm", 2, "warm_start=true", "warm_start_examples=2", f"retriever={url}",
                   "retrieval_deadline_s=1")
    try:
        code = run.finish()
    finally:
        run.kill()
    output = run.output
    assert code == 75, output[-3000:]
    assert "Traceback" not in output
    paragraph = next(line for line in output.splitlines() if line.startswith("eviback train: the retrieval service"))
    assert f"the retrieval service at {url} did not answer for 1 s" in paragraph
    assert "before its first step" in paragraph and "--resume" in paragraph
    assert not (run.root / "metrics.jsonl").exists()
