"""The state of an E2E-APE run, rebuilt from its event log.

:class:`RunState` holds what the logged events say: candidates proposed and rejected, judged conditions,
decisions, feedback, rounds, the selection, the sealed test and its confirmation, paraphrases, the frozen
policy. :meth:`RunState.apply` folds one event into it; replaying a log gives the state of the run that
wrote it. It holds no backend and makes no call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eviback.ape.events import (
    CandidateEvaluated,
    CandidateProposed,
    CandidateRejected,
    ConditionJudged,
    EvaluatedOnTest,
    FeedbackScored,
    PolicyFrozen,
    ProposalRejected,
    QuestionsParaphrased,
    RoundFinished,
    RoundStarted,
    Selected,
    TestConfirmation,
    UnsealedTest,
)
from eviback.ape.records import (
    Candidate,
    Condition,
    ConditionResult,
    Confirmation,
    RejectedProposal,
    Selection,
    Split,
)


@dataclass
class RunState:
    """What a run's events say so far (see the module doc)."""

    candidates: dict[str, Candidate] = field(default_factory=dict)  # in the order proposed
    rejected: dict[str, RejectedProposal] = field(default_factory=dict)  # invalid proposals, by slot
    results: dict[tuple[str, Split, Condition, int], ConditionResult] = field(default_factory=dict)
    decided: dict[str, CandidateRejected | CandidateEvaluated] = field(default_factory=dict)
    feedback: dict[str, FeedbackScored] = field(default_factory=dict)
    rounds: dict[int, RoundFinished] = field(default_factory=dict)
    round_parents: dict[int, str] = field(default_factory=dict)
    tests: dict[str, EvaluatedOnTest] = field(default_factory=dict)
    selected: tuple[int, Selection] | None = None  # (the selection event's sequence number, the selection)
    unsealed: UnsealedTest | None = None
    frozen: PolicyFrozen | None = None
    confirmation: Confirmation | None = None
    paraphrases: dict[str, str] = field(default_factory=dict)  # question id -> paraphrase
    paraphrase_fallbacks: set[str] = field(default_factory=set)  # questions the controller could not paraphrase

    def apply(self, seq: int, event: object) -> None:
        """Fold the logged event number `seq` into the state."""
        if isinstance(event, CandidateProposed):
            self.candidates[event.candidate.id] = event.candidate
        elif isinstance(event, ProposalRejected):
            self.rejected[event.proposal.id] = event.proposal
        elif isinstance(event, ConditionJudged):
            r = event.result
            self.results[(r.candidate_id, r.split, r.condition, r.sample)] = r
        elif isinstance(event, CandidateRejected | CandidateEvaluated):
            self.decided[event.candidate_id] = event
        elif isinstance(event, FeedbackScored):
            self.feedback[event.candidate_id] = event
        elif isinstance(event, RoundFinished):
            self.rounds[event.round] = event
        elif isinstance(event, RoundStarted):
            self.round_parents[event.round] = event.parent
        elif isinstance(event, Selected):
            self.selected = (seq, event.selection)
        elif isinstance(event, UnsealedTest):
            self.unsealed = event
        elif isinstance(event, EvaluatedOnTest):
            self.tests[event.candidate_id] = event
        elif isinstance(event, TestConfirmation):
            self.confirmation = event.confirmation
        elif isinstance(event, QuestionsParaphrased):
            for qid, text in event.paraphrases:
                self.paraphrases.setdefault(qid, text)  # a given paraphrase (data.paraphrases) wins
            self.paraphrase_fallbacks.update(event.fallbacks)
        elif isinstance(event, PolicyFrozen):
            self.frozen = event

    def order(self, candidate: Candidate) -> int:
        """The position of `candidate` among the proposals (earlier wins ties)."""
        return list(self.candidates).index(candidate.id)
