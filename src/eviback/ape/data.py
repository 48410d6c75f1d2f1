"""Stage 1 of a run: the actor's rollouts on training questions, labelled, split by question (test sealed).

- rollouts come from dumps of the actor (training rollout dumps, bare trajectories); the rollouts of all-zero
  groups (no verified hit) first, then others only to balance the S and I labels (`data.balance_labels`);
  with `data.all_zero_only` only the all-zero groups are kept;
- a question of one of the data suite's evaluation files (by id or by normalised text) is refused: the
  teacher is never selected on benchmark items;
- labels are the evidence labels of :mod:`eviback.teacher.labels` (the objective);
- the split is by a salted hash of the question id; the test split is sealed until the final report.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence

from eviback.ape.config import ApeConfig
from eviback.ape.rollouts import (
    RolloutSplits,
    as_rollouts,
    keep_all_zero,
    read_dump,
    split_rollouts,
    trajectory_sha256,
)
from eviback.ape.spec import ConstraintSpec
from eviback.data import eval_overlap, file_sha256, load_suite
from eviback.teacher.labels import trajectory_label
from eviback.types import Status, Trajectory


def refuse_eval_questions(trajectories: Sequence[Trajectory], suite: str | None) -> None:
    """Raise when a rollout's question is one of the suite's evaluation questions (by id or text)."""
    leaked = sorted({q.id for q in eval_overlap({t.question.id: t.question for t in trajectories}.values(),
                                                load_suite(suite))})
    if leaked:
        raise ValueError(
            f"{len(leaked)} rollout question(s) are evaluation questions of the data suite "
            f"{suite or '(embedded)'} (e.g. {leaked[:3]}): E2E-APE selects the teacher on the actor's rollouts "
            f"on training questions only; give training rollout dumps (rollouts/step-<N>.jsonl.gz), or --suite "
            f"for the suite the rollouts' questions come from")


def all_zero_first_balanced(trajectories: Sequence[Trajectory], salt: str) -> list[Trajectory]:
    """Every rollout of the all-zero groups, then rollouts of the other questions (in an order fixed by a
    salted hash of their keys) each only while its evidence label is the rarer of S and I so far. A-labelled
    rollouts of other questions are left out (they do not serve the balance)."""
    zero = keep_all_zero(trajectories)
    zero_ids = {t.question.id for t in zero}
    counts = Counter(trajectory_label(t) for t in zero)
    others = [t for t in trajectories if t.question.id not in zero_ids]
    others.sort(key=lambda t: hashlib.sha256(f"{salt}\x00{t.question.id}\x00{trajectory_sha256(t)}".encode()).hexdigest())
    chosen = list(zero)
    for t in others:
        label = trajectory_label(t)
        if label is Status.AMBIGUOUS:
            continue
        other = Status.INSUFFICIENT if label is Status.SUFFICIENT else Status.SUFFICIENT
        if counts[label] < counts[other]:
            chosen.append(t)
            counts[label] += 1
    return chosen


def load_data(config: ApeConfig, spec: ConstraintSpec) -> tuple[RolloutSplits, tuple[str, ...], int]:
    """The split rollouts, a description of the inputs, and how many duplicates were dropped."""
    trajectories = []
    inputs = []
    for path in config.dumps:
        trajectories += read_dump(path)
        inputs.append(f"dump {path} sha256:{file_sha256(path)[:16]}")
    refuse_eval_questions(trajectories, config.suite)
    if spec.data.all_zero_only:
        trajectories = keep_all_zero(trajectories)
    elif spec.data.balance_labels:
        trajectories = all_zero_first_balanced(trajectories, spec.data.salt)
    rollouts, duplicates = as_rollouts(trajectories)
    splits = split_rollouts(rollouts, salt=spec.data.salt, train=spec.data.train, validation=spec.data.validation)
    labelled = sum(r.sufficient is not None for r in splits.validation)
    if labelled < spec.objective.min_labelled:
        raise ValueError(
            f"the validation split has {labelled} rollouts labelled S or I (eviback.teacher.labels), fewer than "
            f"objective.min_labelled={spec.objective.min_labelled}: add rollout dumps (more questions), or "
            f"lower min_labelled")
    if len(splits.test) == 0 or not splits.train:
        raise ValueError(f"{len(rollouts)} rollouts leave an empty train or test split; add rollouts (more "
                         f"questions) or change data.train/validation/test")
    return splits, tuple(inputs), duplicates
