"""`build_training` for real with the policy-server backend (TRL's server mode), the server played by a
recording stand-in (the real push runs over NCCL between two GPUs): the run's policy is pushed once, before
the starting evaluation and the trainer, each tensor staged on the trainer's device (a policy loaded on the
host would be refused by NCCL), and a resumed run pushes its checkpoint's weights, not the starting ones.
The refusals before any work (a CPU trainer, a server that cannot take a push) are tested in
tests/test_policy_server.py."""

from __future__ import annotations

import contextlib
import json

import torch

from eviback import dtype as dtypes
from eviback.device import Placement
from eviback.policy import resolve_model
from eviback.train.config import TrainConfig
from eviback.train.run import RunDir
from eviback.train.runner import RunStart, build_training


class RecordingServer:
    """A policy server shared by every process, as the trainer sees one: it records each push."""

    name = "vllm-server"
    shared = True
    max_context = 4096

    def __init__(self) -> None:
        from eviback.policy import DEFAULT_MODEL, load_tokenizer

        self.tokenizer = load_tokenizer(DEFAULT_MODEL)
        self.pushes: list[dict[str, torch.Tensor]] = []

    def update_weights(self, weights) -> None:
        self.pushes.append({name: tensor for name, tensor in weights})


class OneProcess:
    is_main_process = True
    num_processes = 1
    process_index = 0

    def wait_for_everyone(self) -> None:
        pass

    @contextlib.contextmanager
    def main_process_first(self):
        yield


def start(root, config: TrainConfig, device: str, *, resume: bool) -> RunStart:
    run = RunDir(root)
    resumed_from = run.start(config, resume=resume)
    return RunStart(OneProcess(), run, resumed_from, run.last_checkpoint(),
                    Placement(device, dtypes.choose("float32", "cpu"), device, "test"))


CONFIG = dict(warm_start=False, backend="vllm-server", dtype="float32", max_steps=4, save_steps=2,
              questions_per_step=1, group_size=2)


def test_the_first_push_is_staged_on_the_trainers_device(tmp_path):
    """A trainer on a GPU (played by `meta`) loads its policy on the host: every tensor of the first push is on
    the GPU, and every parameter is pushed."""
    config = TrainConfig.from_settings(CONFIG)
    server = RecordingServer()
    try:
        training = build_training(config, start(tmp_path / "run", config, "meta", resume=False), server)
    finally:
        RunDir(tmp_path / "run").unlock()
    (push,) = server.pushes
    assert set(push) == {name for name, _ in training.model.named_parameters()}
    assert {t.device.type for t in push.values()} == {"meta"}
    assert training.backend is server


def test_a_resumed_run_pushes_its_checkpoints_weights(tmp_path):
    config = TrainConfig.from_settings(CONFIG)
    root = tmp_path / "run"
    RunDir(root).start(config, resume=False)
    RunDir(root).unlock()
    from transformers import AutoModelForCausalLM

    checkpoint = root / "checkpoints" / "checkpoint-2"
    model = AutoModelForCausalLM.from_pretrained(resolve_model(config.model, "float32"), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)  # weights no starting policy has
    model.save_pretrained(checkpoint)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    server = RecordingServer()
    try:
        build_training(config, start(root, config, "cpu", resume=True), server)
    finally:
        RunDir(root).unlock()
    (push,) = server.pushes
    expected = dict(model.named_parameters())
    assert set(push) == set(expected)
    for name, tensor in push.items():
        torch.testing.assert_close(tensor, expected[name].detach(), msg=name)
