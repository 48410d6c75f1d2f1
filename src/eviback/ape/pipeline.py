"""The E2E-APE run: data -> propose -> evaluate -> select -> sealed test and confirm -> freeze -> report.

    from eviback.ape import ApeConfig, load_spec, run_ape
    result = run_ape(ApeConfig(out="runs/ape", dumps=("runs/x/rollouts/step-40.jsonl.gz",)), load_spec())
    result.frozen_path        # the winner as a frozen teacher policy (`eviback judge --policy`, train `teacher:`)

The run is a short sequence of named stages, each in its own module; every step is logged in
``<out>/events.jsonl`` once complete (a resumed run replays them and redoes only what is missing; teacher and
controller replies are cached in ``<out>/cache.sqlite``, so nothing paid is paid twice):

1. ``data``: the actor's rollouts on training questions (evaluation questions refused), labelled by
   `eviback.teacher.labels`, split by question into train / validation / sealed test; the split hashes
   enter the run's identity (a log is only resumed by the same run);
2. ``propose``: round 0 (the seeds and the systematic variants of the first boundary-compliant seed), then
   controller rounds refining the best candidate so far from its failures on training rollouts
   (``feedback``, shown without gold); every reply is validated before any teacher call;
3. ``evaluate``: static checks, then the validation split phase by phase (base verdicts, canary audit,
   reordered evidence, paraphrased question, repeated sampling), stopping at the first failed gate;
4. ``selection``: the best feasible candidate on the objective (ties to the cheaper), logged;
5. ``sealed``: the test split opened once for that selection; the winner and the manual single-prompt
   baseline measured on it; the spec's freeze rule applied (``confirm``);
6. ``freeze``: a confirmed winner frozen with its provenance; else nothing is frozen, with the reasons;
7. ``report``: ``result.json`` and ``report.md``.

:class:`ApeRun` holds the run's configuration, its backends, its event log and the judging; the state rebuilt
from the log is a :class:`~eviback.ape.state.RunState`, and each stage is given a narrow
:class:`~eviback.ape.context.StageContext`, never the run (so no stage imports this module).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from eviback.ape.config import ApeConfig, ControllerKind, Progress, stderr_progress
from eviback.ape.context import StageContext
from eviback.ape.controller import ChatController, Controller, ControllerSettings, LocalChatClient
from eviback.ape.data import load_data
from eviback.ape.events import (
    CandidateEvaluated,
    CandidateRejected,
    ConditionJudged,
    EventLog,
    RunFinished,
    RunIdentity,
    RunStarted,
)
from eviback.ape.freeze import freeze
from eviback.ape.gates import SELECTION, acceptance
from eviback.ape.measure import STABILITY_CONDITIONS, JudgeBackend, compute_metrics
from eviback.ape.paraphrase import paraphrase_questions
from eviback.ape.propose import controller_round, round_zero
from eviback.ape.records import Candidate, CandidateMetrics, Condition, ConditionResult, Origin, Phase, Split
from eviback.ape.report import ApeResult, CandidateRecord, ProposalCounts, TestComparison, write_outputs
from eviback.ape.rollouts import Rollout, RolloutSplits, load_paraphrases, subset
from eviback.ape.sealed import BASELINE, confirm_on_test, measure_on_test, test_rollouts
from eviback.ape.selection import select
from eviback.ape.spec import ConstraintSpec, spec_yaml
from eviback.ape.state import RunState
from eviback.dtype import resolve as resolve_dtype
from eviback.teacher.cache import ReplyCache
from eviback.teacher.chat import TeacherClient
from eviback.teacher.config import Backend, open_cache
from eviback.teacher.local import LocalClient
from eviback.teacher.openai_http import OpenAIChatClient
from eviback.teacher.policy import TeacherPolicy, load_policy


class ApeRun:
    """One run: its configuration, backends, event log and state, and its steps. Use :func:`run_ape`."""

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
        self._cache: ReplyCache | None = None
        self.inputs = inputs
        self.labels = {r.key: r.sufficient for r in (*splits.train, *splits.validation)}
        self.stability_subset = subset(splits.validation, spec.stability.rollouts, spec.data.salt)
        paraphrases = load_paraphrases(spec.data.paraphrases) if spec.data.paraphrases else {}
        self.log = EventLog(self.out / "events.jsonl")
        self.state = RunState(paraphrases=dict(paraphrases))
        for logged in self.log.events:
            self.state.apply(logged.seq, logged.event)
        self.context = StageContext(
            spec=spec, splits=splits, labels=self.labels, stability_subset=self.stability_subset,
            state=self.state, judging=self, emit=self.emit, progress=progress, controller=lambda: self.controller,
            acceptance=acceptance(spec.search.acceptance), selector=SELECTION["best-feasible"])

    def emit(self, event: object) -> None:
        logged = self.log.append(event)  # type: ignore[arg-type]
        self.state.apply(logged.seq, event)

    # ---- backends (opened only when a step needs them: a fully replayed run loads no model)

    @property
    def cache(self) -> ReplyCache | None:
        if self._cache is None and self.config.cache:
            path = Path(self.config.cache)
            self._cache = open_cache(str(path if path.is_absolute() else self.out / path))
        return self._cache

    @property
    def client(self) -> TeacherClient:
        if self._client is None:
            teacher = self.config.teacher
            if teacher.backend is Backend.LOCAL:
                self.progress(f"loading the local teacher model {teacher.local.model} ({teacher.local.dtype})")
                self._client = LocalClient(teacher.local)
            else:
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
            return f"local:{t.local.model}:{resolve_dtype(t.local.dtype)}"  # what runs here, not `auto`
        return f"openai-http:{t.http.model or t.http.base_url}"

    def controller_id(self) -> str:
        if self._controller is not None:
            return self._controller.controller_id
        c = self.config.controller
        if c.kind is ControllerKind.NONE:
            return "none"
        if c.kind is ControllerKind.LOCAL:
            return f"local-chat:{c.local_model}:{resolve_dtype(c.dtype)}"
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
                    resolve_dtype(self.config.teacher.local.dtype) == resolve_dtype(c.dtype) and \
                    self.config.teacher.local.device == c.device
                chat = LocalChatClient(c.local_model, c.dtype, device=c.device,
                                       model=shared.model if same else None,  # type: ignore[union-attr]
                                       tokenizer=shared.tokenizer if same else None)  # type: ignore[union-attr]
            else:
                chat = OpenAIChatClient(c.http)
            self._controller = ChatController(chat, settings, self.cache)
        return self._controller

    def backend(self) -> JudgeBackend:
        return JudgeBackend(self.client, self.cache, self.config.teacher.judge, paraphrases=self.state.paraphrases,
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
            self.progress(f"resuming {self.out}: {len(self.log.events)} events, {len(self.state.candidates)} candidates")
            return
        (self.out / "spec.yaml").write_text(spec_yaml(self.spec), encoding="utf-8")
        self.emit(RunStarted(identity))
        infos = ", ".join(f"{i.name.value} {i.rollouts} rollouts / {i.questions} questions ({i.labelled} labelled)"
                          for i in identity.splits)
        self.progress(f"started {self.out}: {infos}")

    # ---- judging, replayed when logged

    def judged(self, candidate: Candidate | tuple[str, TeacherPolicy], split: Split, rollouts: Sequence[Rollout],
               condition: Condition, sample: int = 0) -> ConditionResult:
        cid, policy = (candidate.id, candidate.policy) if isinstance(candidate, Candidate) else candidate
        key = (cid, split, condition, sample)
        if key not in self.state.results:
            result = self.backend().judge_condition(cid, policy, split, rollouts, condition, sample, self.progress)
            self.emit(ConditionJudged(result))
        return self.state.results[key]

    def conditions(self, target: Candidate | tuple[str, TeacherPolicy], split: Split, rollouts: Sequence[Rollout],
                    check: str) -> list[ConditionResult]:
        sub = subset(rollouts, self.spec.stability.rollouts, self.spec.data.salt)
        condition = STABILITY_CONDITIONS[check]
        if condition is Condition.SAMPLE:
            return [self.judged(target, split, sub, condition, k) for k in range(1, self.spec.stability.samples)]
        if condition is Condition.PARAPHRASED:
            paraphrase_questions(self.context, sub)  # the controller's paraphrases, where one is available
        return [self.judged(target, split, sub, condition)]

    def metrics(self, policy: TeacherPolicy, cid: str, split: Split) -> CandidateMetrics:
        results = [r for (c, s, _, _), r in self.state.results.items() if c == cid and s == split]
        labels = self.labels if split is not Split.TEST else {r.key: r.sufficient for r in test_rollouts(self.context)}
        return compute_metrics(policy, split, results, labels, self.spec)

    # ---- the whole run

    def run(self) -> ApeResult:
        self.start()
        round_zero(self.context)
        for round_ in range(1, self.spec.search.rounds + 1):
            if round_ in self.state.rounds:
                continue
            if len(self.state.candidates) >= self.spec.search.max_candidates:
                self.progress(f"candidate budget reached ({self.spec.search.max_candidates}); no more rounds")
                break
            controller_round(self.context, round_)
        _, selection = select(self.context)
        if selection.winner is not None:
            winner = self.state.candidates[selection.winner]
            measure_on_test(self.context, winner)
            if confirm_on_test(self.context, winner).confirmed:
                freeze(self.context, winner, self.out / self.config.frozen_name, self.identity())
        result = self.result()
        write_outputs(result, self.out)
        if not self.log.of(RunFinished):
            self.emit(RunFinished(selection.winner))
        self.progress(f"report: {self.out / 'report.md'}")
        return result

    def result(self) -> ApeResult:
        records = []
        for cid, c in self.state.candidates.items():
            d = self.state.decided.get(cid)
            fb = self.state.feedback.get(cid)
            if isinstance(d, CandidateEvaluated):
                records.append(CandidateRecord(c, "feasible", None, (), d.metrics, d.report,
                                               fb.objective if fb else None))
            elif isinstance(d, CandidateRejected):
                records.append(CandidateRecord(c, "rejected", d.phase, d.reasons, d.metrics, d.report,
                                               fb.objective if fb else None))
            else:
                records.append(CandidateRecord(c, "not evaluated", None, (), None, None, fb.objective if fb else None))
        test = None
        selection = self.state.selected[1] if self.state.selected else None
        if selection is not None and selection.winner is not None and self.state.unsealed is not None:
            base_id = self.state.unsealed.candidate_ids[-1]
            w, b = self.state.tests.get(selection.winner), self.state.tests.get(base_id)
            if w is not None and b is not None:
                base_policy = self.state.candidates[base_id].policy if base_id in self.state.candidates else load_policy(BASELINE)
                test = TestComparison(selection.winner, self.state.candidates[selection.winner].policy.name, base_id,
                                      base_policy.name, w.metrics, b.metrics, w.report, b.report)
        calls = sum(o.calls for r in self.state.results.values() for o in r.outcomes)
        proposed = [c for c in self.state.candidates.values() if c.origin is Origin.CONTROLLER]
        static = [self.state.decided.get(c.id) for c in proposed]
        static = [d for d in static if isinstance(d, CandidateRejected) and d.phase is Phase.STATIC]
        leaky = sum(any(r.startswith("evidence boundary") for r in d.reasons) for d in static)
        invalid = sum(p.origin is Origin.CONTROLLER for p in self.state.rejected.values())
        proposals = ProposalCounts(received=len(proposed) + invalid, invalid=invalid, leaky=leaky,
                                   other_static=len(static) - leaky, evaluated=len(proposed) - len(static))
        return ApeResult(
            identity=self.identity(), spec=self.spec, candidates=tuple(records),
            rejected_proposals=tuple(self.state.rejected.values()), selection=selection, test=test,
            confirmation=self.state.confirmation, proposals=proposals,
            frozen_path=self.state.frozen.path if self.state.frozen else "", frozen_version=self.state.frozen.version if self.state.frozen else "",
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
