"""A full disk: what a checkpoint takes (checked against one written as the trainer writes it), the check
before the first step, and a run whose disk fills while it saves a checkpoint, stopped with exit 75 and
continued with --resume (a real `eviback train` in a subprocess whose checkpoint save hits a full disk)."""

from __future__ import annotations

import argparse
import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from eviback.disk import RunFootprint, free_bytes, full_disk_error, size_on_disk
from eviback.train.config import TrainConfig
from run_fakes import stopped_run_dir

GB = 10**9


def test_a_full_disk_is_found_in_the_chain_whatever_raised_it():
    assert full_disk_error(OSError(errno.ENOSPC, "No space left on device")) is not None
    assert full_disk_error(OSError(errno.EDQUOT, "Disk quota exceeded")) is not None
    # safetensors' Rust writer: not an OSError, only its words say it
    rust = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert full_disk_error(rust) is rust
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("the step failed") from e
    except RuntimeError as outer:
        assert isinstance(full_disk_error(outer), OSError)
    assert full_disk_error(OSError(errno.EACCES, "Permission denied")) is None
    assert full_disk_error(ValueError("no space for this")) is None
    looped = RuntimeError("a")
    looped.__context__ = RuntimeError("b")
    looped.__context__.__context__ = looped  # a cycle ends the walk
    assert full_disk_error(looped) is None


def test_free_bytes_of_a_path_not_made_yet_is_its_parents(tmp_path):
    assert free_bytes(tmp_path / "not" / "yet") == free_bytes(tmp_path) > 0


def test_free_space_names_each_file_system_once(tmp_path):
    from eviback.disk import free_space

    same = free_space({"the run directory": tmp_path / "run", "the cache": tmp_path / "cache"})
    assert same.startswith("free now: ") and same.endswith(" under the run directory")
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second file system (/dev/shm) to name")
    two = free_space({"the run directory": tmp_path / "run", "the cache": shm / "cache"})
    assert two.startswith(same + ", ") and two.endswith(f" under the cache ({shm / 'cache'})")


def tiny_model(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).to(dtype)


@pytest.mark.parametrize("masters", [True, False])
def test_the_footprint_is_what_a_checkpoint_takes_on_disk(tmp_path, masters):
    """A checkpoint written the way the trainer writes one (the model by save_pretrained, the masters by
    safetensors, AdamW's state after a step by torch.save) is the size the footprint says, within 2%."""
    from safetensors.torch import save_model

    from eviback.train.precision import MasterWeightAdamW

    if masters:
        model, master = tiny_model(torch.bfloat16), tiny_model(torch.float32)
        optimizer = MasterWeightAdamW(model, master, lr=1e-3)
    else:
        model, master = tiny_model(torch.float32), None
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    if masters:
        optimizer.accumulate()
    optimizer.step()
    folder = tmp_path / "checkpoint-1"
    model.save_pretrained(folder)
    if masters:
        save_model(master, str(folder / "master.safetensors"))
    torch.save(optimizer.state_dict(), folder / "optimizer.pt")
    footprint = RunFootprint.of(model, master, optimizer, steps_left=10, save_steps=5, save_total_limit=1)
    assert footprint.checkpoint == pytest.approx(size_on_disk(folder), rel=0.02)
    assert footprint.final == pytest.approx(size_on_disk(folder / "model.safetensors") if not masters
                                            else size_on_disk(folder / "master.safetensors"), rel=0.01)
    assert footprint.checkpoints_to_write == 2 and footprint.peak == 2 * footprint.checkpoint + footprint.final


def test_the_check_refuses_what_cannot_be_written_and_warns_of_what_may_not():
    runs = RunFootprint(checkpoint=2 * GB, final=GB, checkpoints_to_write=10, save_total_limit=2)
    with pytest.raises(ValueError, match=r"has 1\.5 GB free, too little for its first checkpoint: one checkpoint "
                                         r"of this run takes 2\.0 GB .*final model 1\.0 GB\. Free some, then again"):
        runs.check("runs/x", free=int(1.5 * GB), retry="Free some, then again")
    warning = runs.check("runs/x", free=5 * GB)
    assert warning is not None and "may write 7.0 GB" in warning and "save_total_limit=1" in warning
    assert runs.check("runs/x", free=7 * GB) is None
    # no checkpoints (save_steps=0): the final model is the first and only write
    final_only = RunFootprint(checkpoint=2 * GB, final=GB, checkpoints_to_write=0, save_total_limit=2)
    assert final_only.peak == GB and final_only.check("runs/x", free=GB) is None
    with pytest.raises(ValueError, match="too little for its final model"):
        final_only.check("runs/x", free=GB - 1)
    # fewer checkpoints to write than are kept
    assert RunFootprint(2 * GB, GB, 1, 3).peak == 3 * GB


def paragraph(tmp_path, logged: int, checkpoint: int | None, partial: int | None = None, **settings) -> str:
    from eviback.commands.train import disk_full_message, resume_command

    run = stopped_run_dir(tmp_path / "run", logged, checkpoint)
    if checkpoint is not None:
        (run.checkpoints / f"checkpoint-{checkpoint}" / "model.safetensors").write_bytes(b"0" * 3_000_000)
    if partial is not None:
        (run.checkpoints / f"checkpoint-{partial}").mkdir(parents=True)
        (run.checkpoints / f"checkpoint-{partial}" / "master.safetensors").write_bytes(b"0" * 1_000_000)
    args = argparse.Namespace(preset="grpo", config=None, set=["lam=0.5"], output=str(run.root), resume=False)
    config = TrainConfig.from_settings(max_steps=10, **settings)
    error = OSError(errno.ENOSPC, "No space left on device")
    return disk_full_message(error, config, str(run.root), resume_command(args, str(run.root)))


def test_the_paragraph_says_what_is_kept_what_to_delete_and_how_to_continue(tmp_path):
    text = paragraph(tmp_path, logged=7, checkpoint=5, partial=7, save_steps=5)
    run = tmp_path / "run"
    assert "\n" not in text and text.startswith(f"eviback train: a disk is full (OSError: [Errno {errno.ENOSPC}] No "
                                                f"space left on device), so the run {run} stopped after step 7 of 10; "
                                                "--resume continues from its last complete checkpoint, step 5: steps "
                                                "6-7 are redone. Free now: ")
    assert "one checkpoint of this run takes 3 MB" in text
    assert f"{run / 'checkpoints' / 'checkpoint-7'} did not finish saving (1 MB) and can be deleted" in text
    assert f"`eviback train --preset grpo --set lam=0.5 --output {run} --resume`" in text
    assert "`--set save_total_limit=1`, now 2" in text


@pytest.mark.parametrize("logged, checkpoint, settings, says", [
    (3, 2, {"save_steps": 1}, "after step 3 of 10; --resume continues from its last complete checkpoint, step 2: "
                              "step 3 is redone"),
    (3, 3, {"save_steps": 1}, "after step 3 of 10; --resume continues from its checkpoint at step 3, with no step "
                              "redone"),
    (10, 10, {}, "after its last step (10 of 10), writing the final model or evaluating it; --resume writes the "
                 "final model again and evaluates it, with no step redone"),
    (2, None, {}, "after step 2 of 10; it had no complete checkpoint yet, so --resume starts it over"),
    (0, None, {}, "before its first step was done (in the warm start, or the first rollouts)"),
    (2, None, {"save_steps": 0}, "the run writes no checkpoints (save_steps=0), so --resume starts it over"),
])
def test_the_paragraph_says_what_resuming_redoes(tmp_path, logged, checkpoint, settings, says):
    assert says in paragraph(tmp_path, logged, checkpoint, **settings)


def test_any_other_command_says_a_full_disk_in_one_line(monkeypatch, capsys):
    from eviback.cli import main
    from eviback.commands import data

    def full(args):
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(data, "run", full)
    assert main(["data", "validate", "qa.jsonl"]) == 75
    err = capsys.readouterr().err
    assert err.startswith("eviback data: the disk is full (RuntimeError: Error while serializing") and \
        "free space and run the same command again" in err and "Traceback" not in err


# A real run in a subprocess whose checkpoint at `step` hits a full disk after writing part of it; free space
# reported as `free` bytes (None: the real figure).
CHILD = textwrap.dedent("""
    import errno, os, sys
    import eviback.disk
    from eviback.train.grpo import EviBackTrainer

    full_at, free = int(sys.argv[1]), sys.argv[2]
    if free != "none":
        eviback.disk.free_bytes = lambda path: int(free)
    save = EviBackTrainer._save_checkpoint

    def filling(self, model, trial):
        if self.state.global_step == full_at:
            folder = os.path.join(self.args.output_dir, f"checkpoint-{full_at}")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "model.safetensors"), "wb") as f:
                f.write(b"0" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(self, model, trial)

    EviBackTrainer._save_checkpoint = filling
    from eviback.cli import main
    sys.exit(main(sys.argv[3:]))
""")

TINY = {"backend": "hf", "warm_start": False, "group_size": 2, "questions_per_step": 2, "max_turns": 1,
        "max_turn_tokens": 24, "max_obs_tokens": 64, "save_steps": 1, "teacher_stage_a": "prompted",
        "train_files": ["popqa_train"], "max_steps": 2, "eval_benchmarks": []}


def train(tmp_path, args: list[str] | None = None, *, full_at: int = 0, free: int | None = None):
    """`eviback train ARGS` (by default the tiny run into tmp_path/run) in a subprocess: its checkpoint at step
    `full_at` hits a full disk after writing part of it, and the free space reads `free` bytes (None: the real
    figure)."""
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    if args is None:
        args = ["train", "--preset", "grpo", "--config", str(config), "--output", str(tmp_path / "run")]
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", CHILD, str(full_at), "none" if free is None else str(free), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=1500)


@pytest.mark.slow
def test_a_disk_too_small_for_one_checkpoint_is_refused_before_the_first_step(tmp_path):
    result = train(tmp_path, free=10_000_000)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "eviback train: error: the disk holding" in result.stderr and "Traceback" not in result.stderr
    assert "has 10 MB free, too little for its first checkpoint: one checkpoint of this run takes" in result.stderr
    assert "run the same command with --resume (nothing was trained yet), or train into a directory on another " \
           "disk (--output)" in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_run_whose_disk_fills_in_a_checkpoint_stops_and_resumes(tmp_path):
    result = train(tmp_path, full_at=2)
    assert result.returncode == 75, result.stderr[-3000:]
    run = tmp_path / "run"
    lines = [line for line in result.stderr.splitlines() if line.startswith("eviback train:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines[0].startswith(f"eviback train: a disk is full (OSError: [Errno {errno.ENOSPC}] No space left on "
                               f"device), so the run {run} stopped after step 2 of 2; --resume continues from its last "
                               "complete checkpoint, step 1: step 2 is redone. Free now: ")
    assert f"{run / 'checkpoints' / 'checkpoint-2'} did not finish saving" in lines[0]
    assert [json.loads(m)["step"] for m in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    # the printed command, run once there is space, finishes the run; the half-written checkpoint is redone
    command = lines[0].split("continue the run with `")[1].split("`")[0].split()
    assert command[:2] == ["eviback", "train"] and command[-1] == "--resume"
    resumed = train(tmp_path, command[1:])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [json.loads(m)["step"] for m in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (run / "checkpoints" / "checkpoint-2" / "trainer_state.json").exists()
    assert (run / "final" / "model.safetensors").exists()
