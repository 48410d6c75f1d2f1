"""The configuration of an `eviback experiment`: arms, seeds, steps and held-out sets, in one YAML file.

    name: cpu                      # names the work directory (runs/experiments/<name>)
    out: results/experiment-cpu    # what is kept (and committed): per arm and seed, and the comparison
    launch: [accelerate, launch, --num_processes, "8", -m]   # optional: how each run starts (default: python -m)
    steps: 40                      # optimisation steps of every run
    baseline: grpo                 # the arm every other arm is compared with, item by item
    contrasts: [[eviback, eviback-single-prompt]]   # optional: more "a - b" comparisons of two arms
    settings: {group_size: 5, learning_rate: 1.0e-5, ...}   # `eviback train` settings shared by every arm
    eval: {benchmarks: [nq, popqa, hotpotqa], limit: 100}
    arms:
      - {name: grpo, preset: grpo, seeds: [0, 1]}
      - {name: eviback, preset: eviback, seeds: [0, 1]}
      - {name: eviback-lam1, preset: eviback, seeds: [0], settings: {lam: 1.0}}

A run's training configuration is the arm's preset, then the shared settings, then the arm's own settings,
then what the experiment fixes for every run: `max_steps`, `seed`, and the held-out evaluation. Every run of
one seed sees the same training questions and rollout seeds, and every run starts from the same cached warm
start (`build_seed`), so arms differ only in what they are meant to differ in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from eviback.settings import check_fields
from eviback.train.config import TrainConfig, load_preset

# Settings an experiment sets for every run itself; a config that sets them is refused (it would not mean
# what it says).
OWNED = ("max_steps", "seed", "eval_benchmarks", "eval_limit", "eval_warm_start")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Arm:
    """One training recipe, run once per seed."""

    name: str
    preset: str
    seeds: tuple[int, ...] = (0,)
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_fields(self)  # types first: a seed is an integer, settings a mapping
        if not NAME.match(self.name):
            raise ValueError(f"arm name {self.name!r} must be letters, digits, '.', '_' or '-'")
        if not self.preset:
            raise ValueError(f"arm {self.name!r}: preset must name a training preset (eviback, grpo, dapo, ...)")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"arm {self.name!r}: seeds must be distinct integers, got {list(self.seeds)}")


@dataclass(frozen=True)
class ExperimentConfig:
    name: str
    out: Path
    steps: int
    arms: tuple[Arm, ...]
    eval_benchmarks: tuple[str, ...]
    eval_limit: int
    baseline: str = "grpo"
    settings: dict[str, Any] = field(default_factory=dict)
    work: Path | None = None  # run directories with checkpoints (not kept); default runs/experiments/<name>
    bootstrap_samples: int = 2000
    bootstrap_seed: int = 0
    # how a run's `eviback.cli train` module is started: `python -m` by default; e.g. [accelerate, launch,
    # --num_processes, "8", -m] for several GPUs
    launch: tuple[str, ...] = ()
    # further comparisons than each arm against the baseline: (a, b) reports "a - b", run s against run s
    contrasts: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        # The messages name the keys of an experiment file (`eval.limit` is eval_limit), as parse_experiment
        # reads them.
        check_fields(self)  # types first: the checks below compare numbers
        if not NAME.match(self.name):
            raise ValueError(f"name {self.name!r} must be letters, digits, '.', '_' or '-'")
        if not all(isinstance(a, Arm) for a in self.arms):
            raise ValueError(f"arms must be Arm records (parse_experiment builds them from a file), got "
                             f"{list(self.arms)!r}")
        names = [a.name for a in self.arms]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"arms must be a non-empty list of distinct names, got {names}")
        if not self.eval_benchmarks:
            raise ValueError("eval.benchmarks must name at least one held-out set")
        for key, value, low in (("steps", self.steps, 1), ("eval.limit", self.eval_limit, 1),
                                ("bootstrap_samples", self.bootstrap_samples, 100),
                                ("bootstrap_seed", self.bootstrap_seed, 0)):
            if value < low:
                raise ValueError(f"{key} must be >= {low}, got {value}")
        self.arm(self.baseline)  # raises when the baseline is not an arm
        for i, pair in enumerate(self.contrasts):
            if len(pair) != 2 or pair[0] == pair[1]:
                raise ValueError(f"contrasts[{i}] must be a pair of two different arms [a, b] (reported as a - b), "
                                 f"got {list(pair)}")
            for name in pair:
                self.arm(name)  # raises when a contrast names no arm

    @property
    def work_dir(self) -> Path:
        return self.work if self.work is not None else Path("runs") / "experiments" / self.name

    def arm(self, name: str) -> Arm:
        for arm in self.arms:
            if arm.name == name:
                return arm
        raise ValueError(f"no arm named {name!r}; arms: {', '.join(a.name for a in self.arms)}")

    def runs(self) -> list[tuple[Arm, int]]:
        """Every (arm, seed) in the order they run: seed by seed, so that the first seed of every arm is done
        before any second seed (an interrupted experiment still has one complete comparison)."""
        seeds = sorted({s for a in self.arms for s in a.seeds})
        return [(arm, seed) for seed in seeds for arm in self.arms if seed in arm.seeds]

    def train_config(self, arm: Arm, seed: int) -> TrainConfig:
        """The full training configuration of one run."""
        values = {**load_preset(arm.preset), **self.settings, **arm.settings, "max_steps": self.steps,
                  "seed": seed, "eval_benchmarks": list(self.eval_benchmarks), "eval_limit": self.eval_limit,
                  "eval_warm_start": False}
        return TrainConfig.from_settings(values)


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _contrasts(value: Any, source: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for i, pair in enumerate(value or []):
        if not isinstance(pair, list | tuple) or len(pair) != 2 or pair[0] == pair[1]:
            raise ValueError(f"{source}: contrasts[{i}] must be a pair of two different arms [a, b] "
                             f"(reported as a - b), got {pair!r}")
        pairs.append((str(pair[0]), str(pair[1])))
    return tuple(pairs)


def parse_experiment(spec: dict[str, Any], source: str = "<experiment>") -> ExperimentConfig:
    """Validate an experiment mapping (as loaded from YAML). Every run's training configuration is resolved
    here, so that a bad setting stops the experiment before its first run, not hours into it."""
    spec = _mapping(spec, source)
    known = {"name", "out", "work", "steps", "baseline", "settings", "eval", "arms", "bootstrap_samples",
             "bootstrap_seed", "launch", "contrasts"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {unknown}; known: {sorted(known)}")
    for key in ("name", "out", "steps", "eval", "arms"):
        if key not in spec:
            raise ValueError(f"{source}: missing {key!r}")
    settings = _mapping(spec.get("settings"), f"{source}: settings")
    evaluation = _mapping(spec["eval"], f"{source}: eval")
    if not evaluation.get("benchmarks"):
        raise ValueError(f"{source}: eval.benchmarks must name at least one held-out set")
    arms = []
    for i, item in enumerate(spec["arms"] or []):
        item = _mapping(item, f"{source}: arms[{i}]")
        if not NAME.match(str(item.get("name", ""))):
            raise ValueError(f"{source}: arms[{i}] needs a name of letters, digits, '.', '_' or '-'")
        seeds = item.get("seeds", [0])
        if not seeds or not all(isinstance(s, int) for s in seeds) or len(set(seeds)) != len(seeds):
            raise ValueError(f"{source}: arm {item['name']!r}: seeds must be distinct integers, got {seeds!r}")
        arm_settings = _mapping(item.get("settings"), f"{source}: arm {item['name']!r} settings")
        try:
            arms.append(Arm(item["name"], str(item.get("preset", item["name"])), tuple(seeds), arm_settings))
        except ValueError as e:
            raise ValueError(f"{source}: arm {item['name']!r}: {e}") from None
    names = [a.name for a in arms]
    if not arms or len(set(names)) != len(names):
        raise ValueError(f"{source}: arms must be a non-empty list of distinct names, got {names}")
    for where, values in [("settings", settings), *((f"arm {a.name!r} settings", a.settings) for a in arms)]:
        owned = sorted(set(values) & set(OWNED))
        if owned:
            raise ValueError(f"{source}: {where} set {owned}, which the experiment sets for every run "
                             "(steps, seeds, eval)")
    contrasts = _contrasts(spec.get("contrasts"), source)
    try:  # ExperimentConfig checks its values (name, baseline, contrasts, steps, ...): named with the file here
        config = ExperimentConfig(
            name=str(spec["name"]), out=Path(spec["out"]), steps=int(spec["steps"]), arms=tuple(arms),
            eval_benchmarks=tuple(evaluation["benchmarks"]), eval_limit=int(evaluation.get("limit", 100)),
            baseline=str(spec.get("baseline", arms[0].name)), settings=settings,
            work=Path(spec["work"]) if spec.get("work") else None,
            bootstrap_samples=int(spec.get("bootstrap_samples", 2000)),
            bootstrap_seed=int(spec.get("bootstrap_seed", 0)),
            launch=tuple(str(x) for x in spec.get("launch") or ()),
            contrasts=contrasts,
        )
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    for arm, seed in config.runs():
        try:
            config.train_config(arm, seed)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{source}: arm {arm.name!r}: {e}") from e
    return config


def load_experiment(path: str | Path, *, data: str | None = None) -> ExperimentConfig:
    """An experiment file, with the data suite (`--data`) chosen at run time when given."""
    spec = _mapping(yaml.safe_load(Path(path).read_text()), str(path))
    if data is not None:
        spec["settings"] = {**_mapping(spec.get("settings"), f"{path}: settings"), "data": data}
    return parse_experiment(spec, str(path))
