"""Stage 1 of a run: read the rollouts, label them and split them by question (the test split sealed)."""

from __future__ import annotations

from eviback.ape.config import ApeConfig
from eviback.ape.rollouts import (
    RolloutSplits,
    as_rollouts,
    keep_all_zero,
    probe_trajectories,
    read_dump,
    split_rollouts,
)
from eviback.ape.spec import ConstraintSpec
from eviback.data import file_sha256


def load_data(config: ApeConfig, spec: ConstraintSpec) -> tuple[RolloutSplits, tuple[str, ...], int]:
    """The split rollouts, a description of the inputs, and how many duplicates were dropped."""
    trajectories = []
    inputs = []
    for path in config.dumps:
        trajectories += read_dump(path)
        inputs.append(f"dump {path} sha256:{file_sha256(path)[:16]}")
    if config.probes > 0:
        trajectories += probe_trajectories(config.probes, config.suite, config.probe_datasets, config.probe_seed)
        inputs.append(f"probes n={config.probes} suite={config.suite or 'embedded'} "
                      f"datasets={','.join(config.probe_datasets)} seed={config.probe_seed}")
    if spec.data.all_zero_only:
        trajectories = keep_all_zero(trajectories)
    rollouts, duplicates = as_rollouts(trajectories)
    splits = split_rollouts(rollouts, salt=spec.data.salt, train=spec.data.train, validation=spec.data.validation)
    labelled = sum(r.sufficient is not None for r in splits.validation)
    if labelled < spec.objective.min_labelled:
        raise ValueError(
            f"the validation split has {labelled} rollouts with a sufficiency label (questions with "
            f"metadata.gold_passage_ids), fewer than objective.min_labelled={spec.objective.min_labelled}: add "
            f"rollouts on nq_oracle / popqa / *_ctx questions, or probes (--probes N), or lower min_labelled")
    if len(splits.test) == 0 or not splits.train:
        raise ValueError(f"{len(rollouts)} rollouts leave an empty train or test split; add rollouts (more "
                         f"questions) or change data.train/validation/test")
    return splits, tuple(inputs), duplicates
