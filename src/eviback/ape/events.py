"""The append-only event log of an E2E-APE run: what happened, in order, as typed records.

Every step that costs calls or makes a decision is logged once it is complete: a candidate proposed or a
proposal rejected, a condition judged (with every rollout's outcome), a candidate rejected or evaluated, a
round finished, the selection, the unsealing of the test split, the test evaluations, the sealed test's
confirmation (or not) of the winner, the freeze. A resumed
run replays the log and redoes only what is missing (the teacher's reply cache makes even a half-judged
condition cheap to redo), so an interrupted run never repeats a paid call and ends with the same result.

A line is `{"schema_version", "seq", "kind", "data"}`; `data` is the event record (`eviback.types.to_dict`).
A line torn by a kill mid-write is the only thing dropped on reading (it is always the last one). An event
holds plain values and the records of :mod:`eviback.ape.records` only, so the schema does not move with the
logic that produces them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eviback.ape.records import (
    Candidate,
    CandidateMetrics,
    ConditionResult,
    Confirmation,
    GateReport,
    Phase,
    RejectedProposal,
    Selection,
    Split,
    SplitInfo,
)
from eviback.types import from_dict, to_dict

EVENTS_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class RunIdentity:
    """What a run is: a log is resumed only by a run with the same identity."""

    spec_sha256: str
    splits: tuple[SplitInfo, ...]
    teacher_backend: str
    controller: str  # the controller's id, or "none"
    inputs: tuple[str, ...]  # the dumps (path and sha256), for the record


@dataclass(frozen=True)
class RunStarted:
    identity: RunIdentity


@dataclass(frozen=True)
class CandidateProposed:
    candidate: Candidate


@dataclass(frozen=True)
class ProposalRejected:
    proposal: RejectedProposal


@dataclass(frozen=True)
class ConditionJudged:
    result: ConditionResult


@dataclass(frozen=True)
class CandidateRejected:
    candidate_id: str
    phase: Phase
    reasons: tuple[str, ...]
    report: GateReport
    metrics: CandidateMetrics | None = None  # what was measured before the rejection


@dataclass(frozen=True)
class FeedbackScored:
    """A candidate judged on the training feedback rollouts (to find failures, or for acceptance)."""

    candidate_id: str
    objective: float | None


@dataclass(frozen=True)
class CandidateEvaluated:
    candidate_id: str
    metrics: CandidateMetrics
    report: GateReport  # every gate passed


@dataclass(frozen=True)
class RoundStarted:
    round: int
    parent: str  # the candidate this round refines


@dataclass(frozen=True)
class RoundFinished:
    round: int
    parent: str


@dataclass(frozen=True)
class Selected:
    selection: Selection


@dataclass(frozen=True)
class UnsealedTest:
    selection_seq: int  # the seq of the Selected event the test split was opened for
    candidate_ids: tuple[str, ...]  # evaluated on it: the winner and the manual baseline


@dataclass(frozen=True)
class EvaluatedOnTest:
    candidate_id: str
    split: Split
    metrics: CandidateMetrics
    report: GateReport


@dataclass(frozen=True)
class TestConfirmation:
    confirmation: Confirmation


@dataclass(frozen=True)
class QuestionsParaphrased:
    controller: str
    paraphrases: tuple[tuple[str, str], ...]  # (question id, the controller's paraphrase)
    fallbacks: tuple[str, ...]  # question ids whose reply was unusable: the rule-based rewording is used


@dataclass(frozen=True)
class PolicyFrozen:
    path: str
    version: str


@dataclass(frozen=True)
class RunFinished:
    winner: str | None


Event = (RunStarted | CandidateProposed | ProposalRejected | ConditionJudged | CandidateRejected | FeedbackScored
         | CandidateEvaluated | RoundStarted | RoundFinished | Selected | UnsealedTest | EvaluatedOnTest | TestConfirmation
         | QuestionsParaphrased | PolicyFrozen | RunFinished)

KINDS: dict[str, type] = {
    "run_started": RunStarted, "candidate_proposed": CandidateProposed, "proposal_rejected": ProposalRejected,
    "condition_judged": ConditionJudged, "candidate_rejected": CandidateRejected,
    "feedback_scored": FeedbackScored, "candidate_evaluated": CandidateEvaluated,
    "round_started": RoundStarted, "round_finished": RoundFinished, "selected": Selected, "test_unsealed": UnsealedTest,
    "test_evaluated": EvaluatedOnTest, "test_confirmation": TestConfirmation,
    "questions_paraphrased": QuestionsParaphrased, "policy_frozen": PolicyFrozen, "run_finished": RunFinished,
}
_KIND_OF = {cls: kind for kind, cls in KINDS.items()}


@dataclass(frozen=True)
class LoggedEvent:
    seq: int
    event: Event


class EventLog:
    """An append-only JSONL log of events; each append is flushed and fsynced before it returns."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._seq = 0
        self.events: list[LoggedEvent] = list(self._read())
        self._seq = self.events[-1].seq + 1 if self.events else 0

    def _read(self) -> Iterator[LoggedEvent]:
        if not self.path.exists():
            return
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        good = 0
        for number, line in enumerate(lines, start=1):
            if not line.endswith("\n"):
                break  # the last line, torn by a kill mid-write: drop it (cut off below); its step is redone
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{self.path}:{number}: not a JSON line; the event log is append-only and was "
                                 f"edited: restore it or start a new run (another --out)") from None
            if doc.get("schema_version") != EVENTS_SCHEMA_VERSION:
                raise ValueError(f"{self.path}:{number}: event schema_version {doc.get('schema_version')!r} is not "
                                 f"{EVENTS_SCHEMA_VERSION}; resume it with the eviback that wrote it, or start anew")
            cls = KINDS.get(doc.get("kind"))
            if cls is None:
                raise ValueError(f"{self.path}:{number}: unknown event kind {doc.get('kind')!r}")
            good += len(line.encode("utf-8"))
            yield LoggedEvent(int(doc["seq"]), from_dict(cls, doc["data"]))
        if good < self.path.stat().st_size:
            with open(self.path, "r+b") as f:
                f.truncate(good)

    def append(self, event: Event) -> LoggedEvent:
        logged = LoggedEvent(self._seq, event)
        line = json.dumps({"schema_version": EVENTS_SCHEMA_VERSION, "seq": self._seq, "kind": _KIND_OF[type(event)],
                           "data": to_dict(event)}, ensure_ascii=False, sort_keys=True)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.events.append(logged)
        self._seq += 1
        return logged

    def of(self, cls: type) -> list:
        return [e.event for e in self.events if isinstance(e.event, cls)]
