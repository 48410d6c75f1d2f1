"""Audits of the evidence boundary: does gold ever reach a stage that must be gold-blind?

Two checks, for the tests and for E2E-APE's hard gate:

- static: :meth:`TeacherPolicy.boundary_violations` (the status stage must not see gold);
- dynamic: :func:`plant_canaries` puts a unique canary string into the gold answers (and the question id and
  metadata) of each rollout; a :class:`CanaryAudit`, passed as `Teacher(on_request=...)`, inspects every
  byte of every request to a gold-blind stage (and to the status stage, whatever it claims to see) and
  records any canary it finds. Cached requests are inspected too.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from eviback.teacher.chat import ChatRequest
from eviback.teacher.policy import TeacherPolicy
from eviback.types import Trajectory


def plant_canaries(trajectories: Sequence[Trajectory], seed: int = 0) -> tuple[list[Trajectory], tuple[str, ...]]:
    """Copies of `trajectories` with a unique canary in each question's gold answers, id and metadata
    (one gold answer is the canary alone, another the original gold with the canary appended)."""
    rng = random.Random(seed)
    planted, canaries = [], []
    for t in trajectories:
        canary = f"CANARY{rng.getrandbits(64):016x}"
        golds = (canary, *(f"{g} {canary}" for g in t.question.golden_answers))
        question = dataclasses.replace(t.question, id=f"{t.question.id}-{canary}", golden_answers=golds,
                                       metadata={**t.question.metadata, "canary": canary})
        planted.append(dataclasses.replace(t, question=question))
        canaries.append(canary)
    return planted, tuple(canaries)


@dataclass(frozen=True)
class Leak:
    stage: str
    canary: str


class CanaryAudit:
    """A request hook that records canaries found in requests to stages that must be gold-blind."""

    def __init__(self, policy: TeacherPolicy, canaries: Sequence[str]) -> None:
        self.blind_stages = {s.name for s in policy.stages if not s.sees_gold} | {policy.status_stage.name}
        self._canaries = [c.encode("utf-8") for c in canaries]
        self._lock = threading.Lock()
        self.checked = 0  # requests to gold-blind stages inspected
        self.leaks: list[Leak] = []

    def __call__(self, request: ChatRequest) -> None:
        if request.stage not in self.blind_stages:
            return
        data = request.canonical_json().encode("utf-8")
        found = [Leak(request.stage, c.decode()) for c in self._canaries if c in data]
        with self._lock:
            self.checked += 1
            self.leaks.extend(found)
