"""The E2E-APE run: data -> split -> candidates -> gates -> selection -> sealed test -> frozen teacher.

    from eviback.ape import ApeConfig, load_spec, run_ape
    result = run_ape(ApeConfig(out="runs/ape", dumps=("runs/x/rollouts/step-40.jsonl.gz",)), load_spec())
    result.frozen_path        # the winner as a frozen teacher policy (`eviback judge --policy`, train `teacher:`)

Steps, each logged in ``<out>/events.jsonl`` once complete (a resumed run replays them and redoes only what
is missing; teacher and controller replies are cached in ``<out>/cache.sqlite``, so nothing paid is paid
twice):

1. data (`ape.data`): the actor's rollouts on training questions (evaluation questions refused) are keyed,
   labelled by `eviback.teacher.labels` and split by question into train / validation / sealed test; the
   split hashes enter the run's identity (a log is only resumed by the same run);
2. round 0: the seed policies and the systematic variants of the first boundary-compliant seed;
   rounds 1..R: the controller proposes refinements of the current best candidate from its failures on
   training rollouts (shown without gold), plus systematic variants of it;
3. every candidate is checked statically (no call is spent on one that lets gold reach Stage A), then on the
   validation split phase by phase (base verdicts: I overturned, schema, errors, cost; canary audit;
   reordered evidence; paraphrased question; repeated sampling), stopping at its first failed gate;
4. the best feasible candidate on the objective wins (ties to the cheaper); the test split is unsealed for
   that selection only, and the winner and the manual single-prompt dual-task policy are measured on it;
5. the spec's freeze rule is applied on the sealed test (`ape.confirm`): only a confirmed winner is frozen,
   with its gate report, metrics, confirmation and data hashes; otherwise nothing is frozen and the reasons
   are reported; ``result.json`` and ``report.md`` are written.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path

from eviback.ape.candidates import (
    Candidate,
    NotApplicable,
    Origin,
    ProposalError,
    RejectedProposal,
    apply_mutation,
    mutation_names,
    parse_proposal,
    seed_policy,
    static_rejections,
    structure_key,
)
from eviback.ape.config import ApeConfig, ControllerKind, Progress, stderr_progress
from eviback.ape.confirm import Confirmation, confirm
from eviback.ape.controller import (
    EXAMPLE_TEXTS,
    ChatController,
    Controller,
    ControllerSettings,
    FailureExample,
    LocalChatClient,
    ParentSummary,
    controller_messages,
)
from eviback.ape.data import load_data
from eviback.ape.events import (
    CandidateEvaluated,
    CandidateProposed,
    CandidateRejected,
    ConditionJudged,
    EvaluatedOnTest,
    EventLog,
    FeedbackScored,
    PolicyFrozen,
    ProposalRejected,
    RoundFinished,
    RoundStarted,
    RunFinished,
    RunIdentity,
    RunStarted,
    Selected,
    TestConfirmation,
    UnsealedTest,
)
from eviback.ape.gates import (
    SELECTION,
    GateReport,
    Phase,
    Scored,
    Selection,
    acceptance,
    base_gates,
    canary_gates,
    full_report,
    not_applicable,
    not_applicable_gate,
    stability_floor,
    stability_gate,
    static_gates,
)
from eviback.ape.measure import (
    STABILITY_CONDITIONS,
    CandidateMetrics,
    Condition,
    ConditionResult,
    JudgeBackend,
    compute_metrics,
    sufficiency_metrics,
)
from eviback.ape.report import ApeResult, CandidateRecord, ProposalCounts, TestComparison, write_outputs
from eviback.ape.rollouts import (
    Rollout,
    RolloutSplits,
    Split,
    load_paraphrases,
    subset,
)
from eviback.ape.spec import ConstraintSpec, ObjectiveMetric, spec_yaml
from eviback.teacher.chat import TeacherCallError, TeacherClient
from eviback.teacher.config import Backend, open_cache
from eviback.teacher.policy import TeacherPolicy, freeze_policy, load_policy
from eviback.teacher.workflow import blind_view
from eviback.types import Status

log = logging.getLogger(__name__)

BASELINE = "single-prompt-dual-task"  # the manual policy the winner is compared with on the sealed test
BASELINE_ID = "baseline"  # its id when it is not one of the seeds

class ApeRun:
    """One run's state (rebuilt from its event log) and its steps. Use :func:`run_ape`."""

    def __init__(self, config: ApeConfig, spec: ConstraintSpec, splits: RolloutSplits, inputs: tuple[str, ...], *,
                 client: TeacherClient | None = None, controller: Controller | None = None,
                 progress: Progress = stderr_progress) -> None:
        self.config, self.spec, self.splits = config, spec, splits
        self.out = Path(config.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.progress = progress
        self._client = client
        self._injected_client = client is not None
        self._controller = controller
        self._cache = None
        self.inputs = inputs
        self.labels = {r.key: r.sufficient for r in (*splits.train, *splits.validation)}
        self.stability_subset = subset(splits.validation, spec.stability.rollouts, spec.data.salt)
        self.acceptance = acceptance(spec.search.acceptance)
        self.selector = SELECTION["best-feasible"]
        self.paraphrases = load_paraphrases(spec.data.paraphrases) if spec.data.paraphrases else {}
        self.log = EventLog(self.out / "events.jsonl")
        # state rebuilt from the log
        self.candidates: dict[str, Candidate] = {}
        self.rejected: dict[str, RejectedProposal] = {}
        self.results: dict[tuple[str, Split, Condition, int], ConditionResult] = {}
        self.decided: dict[str, CandidateRejected | CandidateEvaluated] = {}
        self.feedback: dict[str, FeedbackScored] = {}
        self.rounds: dict[int, RoundFinished] = {}
        self.round_parents: dict[int, str] = {}
        self.tests: dict[str, EvaluatedOnTest] = {}
        self.selected: tuple[int, Selection] | None = None
        self.unsealed: UnsealedTest | None = None
        self.frozen: PolicyFrozen | None = None
        self.confirmation: Confirmation | None = None
        for logged in self.log.events:
            self._apply(logged.seq, logged.event)

    # ---- state

    def _apply(self, seq: int, event: object) -> None:
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
        elif isinstance(event, PolicyFrozen):
            self.frozen = event

    def _emit(self, event: object) -> None:
        logged = self.log.append(event)  # type: ignore[arg-type]
        self._apply(logged.seq, event)

    # ---- backends (opened only when a step needs them: a fully replayed run loads no model)

    @property
    def cache(self):  # noqa: ANN201 - a ReplyCache or None
        if self._cache is None and self.config.cache:
            path = Path(self.config.cache)
            self._cache = open_cache(str(path if path.is_absolute() else self.out / path))
        return self._cache

    @property
    def client(self) -> TeacherClient:
        if self._client is None:
            teacher = self.config.teacher
            if teacher.backend is Backend.LOCAL:
                from eviback.teacher.local import LocalClient

                self.progress(f"loading the local teacher model {teacher.local.model} ({teacher.local.dtype})")
                self._client = LocalClient(teacher.local)
            else:
                from eviback.teacher.openai_http import OpenAIChatClient

                client = OpenAIChatClient(teacher.http)
                client.list_models()  # fail now, naming the fix, rather than once per rollout
                self._client = client
        return self._client

    def teacher_backend_id(self) -> str:
        """The teacher's identity as configured (an injected client names itself)."""
        if self._client is not None and self._injected_client:
            return self._client.backend_id
        t = self.config.teacher
        if t.backend is Backend.LOCAL:
            return f"local:{t.local.model}:{t.local.dtype}"
        return f"openai-http:{t.http.model or t.http.base_url}"

    def controller_id(self) -> str:
        if self._controller is not None:
            return self._controller.controller_id
        c = self.config.controller
        if c.kind is ControllerKind.NONE:
            return "none"
        if c.kind is ControllerKind.LOCAL:
            return f"local-chat:{c.local_model}:{c.dtype}"
        return f"openai-http:{c.http.model or c.http.base_url}"

    @property
    def controller(self) -> Controller | None:
        if self._controller is None and self.config.controller.kind is not ControllerKind.NONE:
            c = self.config.controller
            # a small local model cannot be relied on to write a whole JSON proposal: it fills a skeleton
            settings = ControllerSettings(self.spec.search.controller_temperature,
                                          self.spec.search.controller_max_tokens, self.spec.search.seed,
                                          skeletons=c.kind is ControllerKind.LOCAL)
            if c.kind is ControllerKind.LOCAL:
                shared = self.client if self.config.teacher.backend is Backend.LOCAL else None
                same = shared is not None and self.config.teacher.local.model == c.local_model and \
                    self.config.teacher.local.dtype == c.dtype
                chat = LocalChatClient(c.local_model, c.dtype, model=shared.model if same else None,  # type: ignore[union-attr]
                                       tokenizer=shared.tokenizer if same else None)  # type: ignore[union-attr]
            else:
                from eviback.teacher.openai_http import OpenAIChatClient

                chat = OpenAIChatClient(c.http)
            self._controller = ChatController(chat, settings, self.cache)
        return self._controller

    def backend(self) -> JudgeBackend:
        return JudgeBackend(self.client, self.cache, self.config.teacher.judge, paraphrases=self.paraphrases,
                            salt=self.spec.data.salt)

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()

    # ---- identity

    def identity(self) -> RunIdentity:
        return RunIdentity(spec_sha256=self.spec.sha256, splits=self.splits.infos(),
                           teacher_backend=self.teacher_backend_id(), controller=self.controller_id(),
                           inputs=self.inputs)

    def start(self) -> None:
        identity = self.identity()
        started = self.log.of(RunStarted)
        if started:
            previous = started[0].identity
            diffs = [name for name in ("spec_sha256", "splits", "teacher_backend", "controller")
                     if getattr(previous, name) != getattr(identity, name)]
            if diffs:
                raise ValueError(f"{self.out} holds another E2E-APE run (different {', '.join(diffs)}); resume it "
                                 f"with the same spec, rollouts and backends, or choose another --out")
            self.progress(f"resuming {self.out}: {len(self.log.events)} events, {len(self.candidates)} candidates")
            return
        (self.out / "spec.yaml").write_text(spec_yaml(self.spec), encoding="utf-8")
        self._emit(RunStarted(identity))
        infos = ", ".join(f"{i.name.value} {i.rollouts} rollouts / {i.questions} questions ({i.labelled} labelled)"
                          for i in identity.splits)
        self.progress(f"started {self.out}: {infos}")

    # ---- judging, replayed when logged

    def judged(self, candidate: Candidate | tuple[str, TeacherPolicy], split: Split, rollouts: Sequence[Rollout],
               condition: Condition, sample: int = 0) -> ConditionResult:
        cid, policy = (candidate.id, candidate.policy) if isinstance(candidate, Candidate) else candidate
        key = (cid, split, condition, sample)
        if key not in self.results:
            result = self.backend().judge_condition(cid, policy, split, rollouts, condition, sample, self.progress)
            self._emit(ConditionJudged(result))
        return self.results[key]

    def _conditions(self, target: Candidate | tuple[str, TeacherPolicy], split: Split, rollouts: Sequence[Rollout],
                    check: str) -> list[ConditionResult]:
        sub = subset(rollouts, self.spec.stability.rollouts, self.spec.data.salt)
        condition = STABILITY_CONDITIONS[check]
        if condition is Condition.SAMPLE:
            return [self.judged(target, split, sub, condition, k) for k in range(1, self.spec.stability.samples)]
        return [self.judged(target, split, sub, condition)]

    def _metrics(self, policy: TeacherPolicy, cid: str, split: Split) -> CandidateMetrics:
        results = [r for (c, s, _, _), r in self.results.items() if c == cid and s == split]
        labels = self.labels if split is not Split.TEST else {r.key: r.sufficient for r in self._test_rollouts()}
        return compute_metrics(policy, split, results, labels, self.spec)

    # ---- evaluation of one candidate on the validation split, gate by gate

    def evaluate(self, c: Candidate) -> None:
        if c.id in self.decided:
            return
        reasons = list(static_rejections(c.policy, max_stages=self.spec.search.max_stages))
        earlier = next((o for o in self.candidates.values() if o.id != c.id and o.structure == c.structure
                        and self._order(o) < self._order(c)), None)
        if earlier is not None:
            reasons.append(f"duplicate of {earlier.id} (the same workflow)")
        if reasons:
            self.progress(f"{c.id} {c.policy.name}: rejected before any call: {'; '.join(reasons)}")
            self._emit(CandidateRejected(c.id, Phase.STATIC, tuple(reasons), GateReport(tuple(static_gates(reasons)))))
            return
        if c.parent and c.round > 0 and self.acceptance.needs_feedback:
            ok, why = self.acceptance.accept(self.feedback_score(c), self.feedback_score(self.candidates[c.parent]))
            if not ok:
                self.progress(f"{c.id}: not accepted: {why}")
                self._emit(CandidateRejected(c.id, Phase.ACCEPTANCE, (why,), GateReport(())))
                return
        self.progress(f"{c.id} {c.policy.name}: evaluating on {len(self.splits.validation)} validation rollouts")
        val = self.splits.validation
        self.judged(c, Split.VALIDATION, val, Condition.BASE)
        gates = static_gates(()) + base_gates(self._metrics(c.policy, c.id, Split.VALIDATION), self.spec)
        if self._reject_if_failed(c, Phase.BASE, gates):
            return
        self.judged(c, Split.VALIDATION, self.stability_subset, Condition.CANARY)
        gates += canary_gates(self._metrics(c.policy, c.id, Split.VALIDATION), self.spec)
        if self._reject_if_failed(c, Phase.CANARY, gates):
            return
        # cheapest first: one extra verdict per rollout for a perturbation, samples-1 for repeated sampling
        for check in ("reordered_evidence", "paraphrased_question", "repeated_sampling"):
            rule = self.spec.stability.checks()[check]
            if not rule.enabled:
                continue
            why = not_applicable(check, c.policy)
            if why:
                gates.append(not_applicable_gate(check, why, rule))
                continue
            self._conditions(c, Split.VALIDATION, val, check)
            metrics = self._metrics(c.policy, c.id, Split.VALIDATION)
            gates.append(stability_gate(check, metrics.stability_of(check), rule, self.spec))
            if self._reject_if_failed(c, Phase.STABILITY, gates):
                return
        metrics = self._metrics(c.policy, c.id, Split.VALIDATION)
        objective = metrics.objective(self.spec.objective.metric)
        self.progress(f"{c.id} {c.policy.name}: FEASIBLE, objective {objective if objective is None else round(objective, 4)}, "
                      f"{metrics.cost.tokens_per_rollout:.0f} tokens/rollout")
        self._emit(CandidateEvaluated(c.id, metrics, GateReport(tuple(gates))))

    def _reject_if_failed(self, c: Candidate, phase: Phase, gates: list) -> bool:
        report = GateReport(tuple(gates))
        if report.passed:
            return False
        metrics = self._metrics(c.policy, c.id, Split.VALIDATION)
        self.progress(f"{c.id} {c.policy.name}: rejected ({phase.value}): {'; '.join(report.reasons())}")
        self._emit(CandidateRejected(c.id, phase, report.reasons(), report, metrics))
        return True

    def _order(self, c: Candidate) -> int:
        return list(self.candidates).index(c.id)

    # ---- feedback on training rollouts (failures for the controller; acceptance)

    def feedback_rollouts(self) -> tuple[Rollout, ...]:
        labelled = [r for r in self.splits.train if r.sufficient is not None] or list(self.splits.train)
        return subset(labelled, self.spec.data.feedback_rollouts, self.spec.data.salt + ":feedback")

    def feedback_result(self, c: Candidate) -> ConditionResult:
        result = self.judged(c, Split.TRAIN, self.feedback_rollouts(), Condition.BASE)
        if c.id not in self.feedback:
            s = sufficiency_metrics(result.outcomes, self.labels, self.spec.objective.ambiguous_credit)
            balanced = self.spec.objective.metric is ObjectiveMetric.BALANCED_AGREEMENT
            self._emit(FeedbackScored(c.id, s.balanced_agreement if balanced else s.agreement))
        return result

    def feedback_score(self, c: Candidate) -> float | None:
        self.feedback_result(c)
        return self.feedback[c.id].objective

    def failures(self, c: Candidate, round_: int) -> tuple[ParentSummary, list[FailureExample]]:
        result = self.feedback_result(c)
        by_key = {r.key: r for r in self.splits.train}
        wrong = []
        for o in result.outcomes:
            label = self.labels.get(o.key)
            if o.status is None or label is None:
                continue
            if (o.status is Status.SUFFICIENT) != label or o.status is Status.AMBIGUOUS:
                wrong.append(o)
        # a different handful each round, deterministically
        wrong.sort(key=lambda o: hashlib.sha256(f"{round_}:{o.key}".encode()).hexdigest())
        examples = [FailureExample.of(blind_view(by_key[o.key].trajectory), o.status, bool(self.labels[o.key]))
                    for o in wrong[: self.spec.search.failures_shown] if o.status is not None]
        s = sufficiency_metrics(result.outcomes, self.labels, self.spec.objective.ambiguous_credit)
        counts = {k: sum(o.status is not None and o.status.value == k for o in result.outcomes) for k in "SAI"}
        summary = ParentSummary(
            rollouts=len(result.outcomes), labelled=s.labelled, balanced_agreement=s.balanced_agreement,
            said_s_on_insufficient=sum(o.status is Status.SUFFICIENT and self.labels.get(o.key) is False
                                       for o in result.outcomes),
            said_i_on_sufficient=sum(o.status is Status.INSUFFICIENT and self.labels.get(o.key) is True
                                     for o in result.outcomes),
            status_counts=tuple(counts.items()))
        return summary, examples

    # ---- proposing

    def propose(self, candidate: Candidate) -> Candidate | None:
        """Log a new valid candidate (unless its slot is taken or the budget is spent)."""
        if candidate.id in self.candidates or candidate.id in self.rejected:
            return self.candidates.get(candidate.id)
        if len(self.candidates) >= self.spec.search.max_candidates:
            return None
        self._emit(CandidateProposed(candidate))
        return candidate

    def reject_proposal(self, proposal: RejectedProposal) -> None:
        if proposal.id not in self.rejected and proposal.id not in self.candidates:
            self.progress(f"{proposal.id}: proposal rejected: {proposal.reason}")
            self._emit(ProposalRejected(proposal))

    def mutations_of(self, parent: Candidate, count: int, round_: int, prefix: str) -> list[Candidate]:
        out: list[Candidate] = []
        taken = {o.structure for o in self.candidates.values()}
        index = 0
        for name in mutation_names(self.spec.search.mutations):
            if len(out) >= count:
                break
            slot = f"{prefix}m{index}"
            if slot in self.candidates:
                out.append(self.candidates[slot])
                index += 1
                continue
            try:
                policy = apply_mutation(name, parent.policy)
            except NotApplicable:
                continue
            if structure_key(policy) in taken:
                continue
            candidate = self.propose(Candidate(slot, policy, Origin.MUTATION, parent.id, round_, name))
            index += 1
            if candidate is None:
                break
            out.append(candidate)
        return out

    def round_zero(self) -> None:
        seeds = []
        for i, ref in enumerate(self.spec.search.seeds):
            c = self.propose(Candidate(f"s{i}", seed_policy(ref), Origin.SEED, "", 0, ref))
            if c is not None:
                seeds.append(c)
        base = next((c for c in seeds if not c.policy.boundary_violations()), None)
        if base is not None and 0 not in self.rounds:
            self.mutations_of(base, len(mutation_names(self.spec.search.mutations)), 0, "")
        for c in list(self.candidates.values()):
            if c.round == 0:
                self.evaluate(c)
        if 0 not in self.rounds:
            self._emit(RoundFinished(0, base.id if base is not None else ""))

    def parent(self) -> Candidate | None:
        """The best candidate so far: the selected feasible one; else the best objective among those with
        base metrics; else the first compliant seed."""
        selection = self.selector.select(self.scored(), self.spec)
        if selection.winner is not None:
            return self.candidates[selection.winner]
        measured = [(d.metrics.objective(self.spec.objective.metric), -self._order(self.candidates[cid]), cid)
                    for cid, d in self.decided.items() if d.metrics is not None
                    and d.metrics.objective(self.spec.objective.metric) is not None]
        if measured:
            return self.candidates[max(measured)[2]]
        return next((c for c in self.candidates.values() if not c.policy.boundary_violations()), None)

    def controller_round(self, round_: int) -> None:
        started = self.round_parents.get(round_)
        parent = self.candidates[started] if started else self.parent()
        if parent is None:
            return
        if not started:  # logged, so that a resumed round refines the same parent
            self._emit(RoundStarted(round_, parent.id))
        prefix = f"r{round_}."
        self.progress(f"round {round_}: refining {parent.id} {parent.policy.name}")
        controller = self.controller
        if controller is not None and self.spec.search.proposals_per_round:
            summary, failures = self.failures(parent, round_)
            whole = not (isinstance(controller, ChatController) and controller.settings.skeletons)
            messages = controller_messages(parent.policy, summary, failures, whole_workflow=whole)
            for p in range(self.spec.search.proposals_per_round):
                slot = f"{prefix}p{p}"
                if slot in self.candidates or slot in self.rejected:
                    continue
                if len(self.candidates) >= self.spec.search.max_candidates:
                    break
                self.progress(f"{slot}: asking the controller {controller.controller_id} for a proposal")
                try:
                    reply = controller.propose(messages, slot=round_ * 100 + p, stage=parent.policy.status_stage.name)
                except TeacherCallError as e:
                    self.reject_proposal(RejectedProposal(slot, Origin.CONTROLLER, parent.id, round_,
                                                          f"controller call failed: {e}"))
                    continue
                try:
                    policy = parse_proposal(reply.text, parent.policy, f"{parent.policy.name}~{slot}")
                    copied = [t for s in policy.stages for t in (s.system_prompt, s.user_template)
                              if t.strip() in EXAMPLE_TEXTS]
                    if copied:
                        raise ProposalError(f"the reply copies the prompt's example ({copied[0]!r}) instead of "
                                            f"proposing a workflow")
                except ProposalError as e:
                    self.reject_proposal(RejectedProposal(slot, Origin.CONTROLLER, parent.id, round_, str(e),
                                                          reply.text[:300]))
                    continue
                self.propose(Candidate(slot, policy, Origin.CONTROLLER, parent.id, round_, "controller proposal"))
        self.mutations_of(parent, self.spec.search.mutations_per_round, round_, prefix)
        for c in [c for c in self.candidates.values() if c.round == round_]:
            self.evaluate(c)
        self._emit(RoundFinished(round_, parent.id))

    # ---- selection, sealed test, freeze

    def scored(self) -> list[Scored]:
        out = []
        for cid in self.candidates:
            d = self.decided.get(cid)
            if isinstance(d, CandidateEvaluated):
                m = d.metrics
                out.append(Scored(cid, True, m.objective(self.spec.objective.metric), m.cost.tokens_per_rollout,
                                  m.cost.requests_per_rollout, stability_floor(m)))
        return out

    def select(self) -> tuple[int, Selection]:
        if self.selected is None:
            selection = self.selector.select(self.scored(), self.spec)
            self._emit(Selected(selection))
            self.progress(f"selected: {selection.winner or 'none'} ({selection.reason})")
        assert self.selected is not None
        return self.selected

    def _test_rollouts(self) -> tuple[Rollout, ...]:
        if self.selected is None:
            raise RuntimeError("the sealed test split is read only after a selection")
        return self.splits.test.unseal(f"selection@{self.selected[0]}")

    def baseline(self) -> tuple[str, TeacherPolicy]:
        policy = load_policy(BASELINE)
        seed = next((c for c in self.candidates.values() if c.origin is Origin.SEED and
                     c.structure == structure_key(policy)), None)
        return (seed.id, seed.policy) if seed is not None else (BASELINE_ID, policy)

    def test_evaluation(self, winner: Candidate) -> None:
        seq, _ = self.selected  # type: ignore[misc]
        base_id, base_policy = self.baseline()
        targets: list[tuple[str, TeacherPolicy]] = [(winner.id, winner.policy), (base_id, base_policy)]
        rollouts = self._test_rollouts()
        if self.unsealed is None:
            self._emit(UnsealedTest(seq, tuple(t[0] for t in targets)))
            self.progress(f"sealed test split opened for selection {seq}: {len(rollouts)} rollouts")
        for cid, policy in targets:
            if cid in self.tests:
                continue
            self.judged((cid, policy), Split.TEST, rollouts, Condition.BASE)
            self.judged((cid, policy), Split.TEST, subset(rollouts, self.spec.stability.rollouts, self.spec.data.salt),
                        Condition.CANARY)
            for check, rule in self.spec.stability.checks().items():
                if rule.enabled and not not_applicable(check, policy):
                    self._conditions((cid, policy), Split.TEST, rollouts, check)
            metrics = self._metrics(policy, cid, Split.TEST)
            rejections = static_rejections(policy, max_stages=self.spec.search.max_stages)
            self._emit(EvaluatedOnTest(cid, Split.TEST, metrics, full_report(metrics, rejections, self.spec, policy)))

    def confirm(self, winner: Candidate) -> Confirmation:
        """The spec's freeze rule on the sealed test (logged once)."""
        if self.confirmation is None:
            base_id = self.unsealed.candidate_ids[-1]  # type: ignore[union-attr]
            labels = {r.key: r.sufficient for r in self._test_rollouts()}
            confirmation = confirm(winner.id, self.results[(winner.id, Split.TEST, Condition.BASE, 0)].outcomes,
                                   self.tests[winner.id].report, base_id, self.tests[base_id].metrics, labels,
                                   self.spec)
            self._emit(TestConfirmation(confirmation))
            verdict = "confirmed" if confirmation.confirmed else "NOT confirmed: " + "; ".join(confirmation.reasons)
            self.progress(f"sealed test: {winner.id} {verdict}")
        assert self.confirmation is not None
        return self.confirmation

    def freeze(self, winner: Candidate) -> PolicyFrozen:
        if self.frozen is None:
            decided = self.decided[winner.id]
            assert isinstance(decided, CandidateEvaluated)
            test = self.tests.get(winner.id)
            from eviback.types import to_dict

            provenance = {
                "method": "E2E-APE (EVIBACK.md section 5)",
                "candidate": winner.id, "origin": winner.origin.value, "parent": winner.parent, "note": winner.note,
                "spec_sha256": self.spec.sha256,
                "splits": [to_dict(i) for i in self.splits.infos()],
                "teacher_backend": self.teacher_backend_id(), "controller": self.controller_id(),
                "gate_report": to_dict(decided.report),
                "validation_metrics": to_dict(decided.metrics),
                "sealed_test_metrics": to_dict(test.metrics) if test is not None else None,
                "selection": to_dict(self.selected[1]) if self.selected else None,
                "sealed_test_confirmation": to_dict(self.confirmation) if self.confirmation else None,
                "inputs": list(self.inputs),
            }
            path = freeze_policy(winner.policy, self.out / self.config.frozen_name, provenance)
            self._emit(PolicyFrozen(str(path), winner.policy.version))
            self.progress(f"froze {winner.policy.name} version {winner.policy.short_version} -> {path}")
        assert self.frozen is not None
        return self.frozen

    # ---- the whole run

    def run(self) -> ApeResult:
        self.start()
        self.round_zero()
        for round_ in range(1, self.spec.search.rounds + 1):
            if round_ in self.rounds:
                continue
            if len(self.candidates) >= self.spec.search.max_candidates:
                self.progress(f"candidate budget reached ({self.spec.search.max_candidates}); no more rounds")
                break
            self.controller_round(round_)
        _, selection = self.select()
        if selection.winner is not None:
            winner = self.candidates[selection.winner]
            self.test_evaluation(winner)
            if self.confirm(winner).confirmed:
                self.freeze(winner)
        result = self.result()
        write_outputs(result, self.out)
        if not self.log.of(RunFinished):
            self._emit(RunFinished(selection.winner))
        self.progress(f"report: {self.out / 'report.md'}")
        return result

    def result(self) -> ApeResult:
        records = []
        for cid, c in self.candidates.items():
            d = self.decided.get(cid)
            fb = self.feedback.get(cid)
            if isinstance(d, CandidateEvaluated):
                records.append(CandidateRecord(c, "feasible", None, (), d.metrics, d.report,
                                               fb.objective if fb else None))
            elif isinstance(d, CandidateRejected):
                records.append(CandidateRecord(c, "rejected", d.phase, d.reasons, d.metrics, d.report,
                                               fb.objective if fb else None))
            else:
                records.append(CandidateRecord(c, "not evaluated", None, (), None, None, fb.objective if fb else None))
        test = None
        selection = self.selected[1] if self.selected else None
        if selection is not None and selection.winner is not None and self.unsealed is not None:
            base_id = self.unsealed.candidate_ids[-1]
            w, b = self.tests.get(selection.winner), self.tests.get(base_id)
            if w is not None and b is not None:
                base_policy = self.candidates[base_id].policy if base_id in self.candidates else load_policy(BASELINE)
                test = TestComparison(selection.winner, self.candidates[selection.winner].policy.name, base_id,
                                      base_policy.name, w.metrics, b.metrics, w.report, b.report)
        calls = sum(o.calls for r in self.results.values() for o in r.outcomes)
        proposed = [c for c in self.candidates.values() if c.origin is Origin.CONTROLLER]
        static = [self.decided.get(c.id) for c in proposed]
        static = [d for d in static if isinstance(d, CandidateRejected) and d.phase is Phase.STATIC]
        leaky = sum(any(r.startswith("evidence boundary") for r in d.reasons) for d in static)
        invalid = sum(p.origin is Origin.CONTROLLER for p in self.rejected.values())
        proposals = ProposalCounts(received=len(proposed) + invalid, invalid=invalid, leaky=leaky,
                                   other_static=len(static) - leaky, evaluated=len(proposed) - len(static))
        return ApeResult(
            identity=self.identity(), spec=self.spec, candidates=tuple(records),
            rejected_proposals=tuple(self.rejected.values()), selection=selection, test=test,
            confirmation=self.confirmation, proposals=proposals,
            frozen_path=self.frozen.path if self.frozen else "", frozen_version=self.frozen.version if self.frozen else "",
            teacher_calls=calls)


def run_ape(config: ApeConfig, spec: ConstraintSpec, *, client: TeacherClient | None = None,
            controller: Controller | None = None, progress: Progress = stderr_progress) -> ApeResult:
    """Run (or resume) E2E-APE. `client` and `controller` replace the configured backends (tests, sharing a
    loaded model); they stay the caller's to close."""
    splits, inputs, duplicates = load_data(config, spec)
    if duplicates:
        progress(f"dropped {duplicates} duplicate rollout(s)")
    run = ApeRun(config, spec, splits, inputs, client=client, controller=controller, progress=progress)
    try:
        return run.run()
    finally:
        run.close()
