"""The learning-rate schedule of a training run: `lr_scheduler_type` and `warmup_ratio` reach TRL's arguments,
the scheduler transformers builds from them follows the warm-up step by step (as verl, Search-R1's trainer,
warms up), bad values are refused naming the fix, and a run is not resumed under another schedule."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from eviback.cli import main
from eviback.train.config import LR_SCHEDULERS, TrainConfig
from eviback.train.run import RunDir
from eviback.train.runner import Precision, trl_arguments


def learning_rates(config: TrainConfig, tmp_path) -> list[float]:
    """The learning rate of each optimisation step of a run of `config`, from the scheduler transformers'
    Trainer builds from the run's GRPOConfig (`Trainer.create_scheduler`, the code a run goes through)."""
    from transformers import Trainer

    args = trl_arguments(config, tmp_path, Precision.FLOAT32, cuda=False)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
    trainer = SimpleNamespace(args=args, optimizer=optimizer, lr_scheduler=None)
    scheduler = Trainer.create_scheduler(trainer, num_training_steps=args.max_steps)
    rates = []
    for _ in range(args.max_steps):  # the rate a step's update uses, then the scheduler's step (as the trainer)
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def verl_constant_with_warmup(step: int, warmup_steps: int) -> float:
    """verl's `get_constant_schedule_with_warmup` factor (Search-R1's verl/utils/torch_functional.py)."""
    return min(1, step / max(1, warmup_steps))


def test_the_default_is_a_constant_rate_without_warm_up(tmp_path):
    config = TrainConfig.from_settings(max_steps=10, learning_rate=1e-5)
    assert (config.lr_scheduler_type, config.warmup_ratio, config.warmup_steps) == ("constant", 0.0, 0)
    args = trl_arguments(config, tmp_path, Precision.FLOAT32, cuda=False)
    assert args.lr_scheduler_type == "constant" and args.get_warmup_steps(10) == 0
    assert learning_rates(config, tmp_path) == [1e-5] * 10


def test_search_r1s_warm_up_reaches_trl_and_counts_steps_as_verl_does(tmp_path):
    config = TrainConfig.from_settings(max_steps=1005, lr_scheduler_type="constant_with_warmup", warmup_ratio=0.285)
    args = trl_arguments(config, tmp_path, Precision.FLOAT32, cuda=False)
    assert args.lr_scheduler_type == "constant_with_warmup"
    assert config.warmup_steps == args.get_warmup_steps(1005) == int(0.285 * 1005) == 286  # verl's int(); not 287
    assert TrainConfig.from_settings(max_steps=100, lr_scheduler_type="linear", warmup_ratio=0.29).warmup_steps == 29


def test_the_learning_rate_of_each_step_follows_the_warm_up(tmp_path):
    """10 steps warming up over 3: 0, 1/3, 2/3 of the rate, then the rate (constant_with_warmup, exactly
    verl's factor) or a linear decay to 0 at max_steps (linear)."""
    lr = 1e-6
    warm = TrainConfig.from_settings(max_steps=10, learning_rate=lr, lr_scheduler_type="constant_with_warmup",
                                     warmup_ratio=0.3)
    assert warm.warmup_steps == 3
    assert learning_rates(warm, tmp_path) == pytest.approx([lr * verl_constant_with_warmup(s, 3) for s in range(10)])
    assert learning_rates(warm, tmp_path)[:4] == pytest.approx([0, lr / 3, 2 * lr / 3, lr])
    linear = warm.with_settings(lr_scheduler_type="linear")
    assert learning_rates(linear, tmp_path) == pytest.approx(
        [lr * s / 3 for s in range(3)] + [lr * (10 - s) / 7 for s in range(3, 10)])
    cosine = learning_rates(warm.with_settings(lr_scheduler_type="cosine"), tmp_path)
    assert cosine[3] == pytest.approx(lr) and cosine[-1] == pytest.approx(lr * 0.5 * (1 + math.cos(math.pi * 6 / 7)))


@pytest.mark.parametrize("name", LR_SCHEDULERS)
def test_every_accepted_schedule_builds(name, tmp_path):
    """Each accepted name builds with only the warm-up and the step count (the others need arguments a run
    does not pass): no run meets a schedule it cannot build after its warm start."""
    config = TrainConfig.from_settings(max_steps=4, lr_scheduler_type=name,
                                       warmup_ratio=0.5 if name != "constant" else 0.0)
    assert len(learning_rates(config, tmp_path)) == 4


BAD = [
    ("warmup_ratio=1.0", ["warmup_ratio", "[0, 1)"]),
    ("warmup_ratio=-0.1", ["warmup_ratio", "[0, 1)"]),
    ("warmup_ratio=nan", ["warmup_ratio", "[0, 1)"]),
    # transformers' constant schedule would ignore the warm-up: the fix is named
    ("warmup_ratio=0.285", ["warmup_ratio", "lr_scheduler_type=constant_with_warmup", "linear", "warmup_ratio=0"]),
    ("lr_scheduler_type=cosine_with_min_lr", ["lr_scheduler_type", "constant_with_warmup", "linear", "cosine"]),
    ("lr_scheduler_type=1", ["lr_scheduler_type"]),
]


@pytest.mark.parametrize(("override", "words"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_schedule_is_refused_before_any_work(override, words, tmp_path, capsys):
    output = tmp_path / "run"
    code = main(["train", "--preset", "demo", "--set", override, "--output", str(output)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("eviback train: error:") and "Traceback" not in err
    for word in words:
        assert word in err, (word, err)
    assert not output.exists()


def test_a_run_is_not_resumed_under_another_schedule(tmp_path):
    """The schedule decides every step's update: a resumed run with another one is refused, naming the
    settings that continue it as it ran; a run made before the settings existed ran today's defaults."""
    import yaml

    warm = {"lr_scheduler_type": "constant_with_warmup", "warmup_ratio": 0.285}
    run = RunDir(tmp_path / "run")
    assert run.start(TrainConfig.from_settings(**warm), resume=False) is None
    for changed in ({"warmup_ratio": 0.1}, {"lr_scheduler_type": "linear"}, {"lr_scheduler_type": "constant",
                                                                              "warmup_ratio": 0.0}):
        with pytest.raises(ValueError, match="cannot resume") as refused:
            run.start(TrainConfig.from_settings(**{**warm, **changed}), resume=True)
        for key in changed:
            assert f"--set {key}={warm[key]}" in str(refused.value)
    assert run.start(TrainConfig.from_settings(**warm), resume=True) is None

    # a config.yaml written before the schedule was a setting: the run trained at a constant rate
    older = yaml.safe_load(run.config_path.read_text())
    for key in warm:
        del older[key]
    run.config_path.write_text(yaml.safe_dump(older))
    assert run.start(TrainConfig(), resume=True) is None
    run.unlock()
