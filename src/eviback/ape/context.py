"""What the stages of an E2E-APE run are given: a narrow, typed context instead of the whole run.

The stages (``propose``, ``evaluate``, ``feedback``, ``paraphrase``, ``selection``, ``sealed``,
``freeze``) read the spec, the splits and the run's state (:class:`~eviback.ape.state.RunState`), log
events with ``emit``, and judge through :class:`Judging`; they never see the run's configuration, its
backends or its outputs. :mod:`eviback.ape.pipeline` builds the context and is the only module that
imports the stages, so no stage imports the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from eviback.ape.config import Progress
from eviback.ape.controller import Controller
from eviback.ape.gates import Acceptance, SelectionStrategy
from eviback.ape.records import Candidate, CandidateMetrics, Condition, ConditionResult, Split
from eviback.ape.rollouts import Rollout, RolloutSplits
from eviback.ape.spec import ConstraintSpec
from eviback.ape.state import RunState
from eviback.teacher.policy import TeacherPolicy

Target = Candidate | tuple[str, TeacherPolicy]  # a candidate, or (id, policy) for a baseline outside the search


class Judging(Protocol):
    """Judging with the run's teacher, replayed from the log when already judged."""

    def judged(self, candidate: Target, split: Split, rollouts: Sequence[Rollout], condition: Condition,
               sample: int = 0) -> ConditionResult:
        """The verdicts of `candidate` on `rollouts` under `condition` (logged once)."""
        ...

    def conditions(self, target: Target, split: Split, rollouts: Sequence[Rollout],
                   check: str) -> list[ConditionResult]:
        """The conditions of the stability check `check` (a spec name, e.g. ``reordered_evidence``)."""
        ...

    def metrics(self, policy: TeacherPolicy, cid: str, split: Split) -> CandidateMetrics:
        """The metrics of candidate `cid` from every condition judged on `split` so far."""
        ...


@dataclass(frozen=True)
class StageContext:
    """What a stage may use of a run."""

    spec: ConstraintSpec
    splits: RolloutSplits
    labels: Mapping[str, bool | None]  # rollout key -> its objective label (train and validation)
    stability_subset: tuple[Rollout, ...]  # the validation rollouts the stability checks use
    state: RunState  # read only: a stage changes it by emitting events
    judging: Judging
    emit: Callable[[object], None]  # log an event and fold it into `state`
    progress: Progress
    controller: Callable[[], Controller | None]  # opened on first use; None without a controller
    acceptance: Acceptance
    selector: SelectionStrategy
