"""Running a teacher policy on one rollout: views, request building, reply parsing, the gate, the reward.

The evidence boundary is enforced here by construction, not by prompt wording:

- :func:`blind_view` copies, from a trajectory, only what a gold-blind stage may see: the question text,
  the evidence *as the actor saw it* (its observations, after the rollout's `max_observation_tokens` cut:
  a passage cut in the actor's context is cut the same way here), and its answer. Never the question's
  gold answers, id or metadata.
- :func:`build_blind_request` (every stage that does not list `gold` in `sees`, so Stage A of a compliant
  policy) receives only that view: it has no way to reach the gold answers. Only
  :func:`build_gold_aware_request` is given a :class:`GoldView`.
- :func:`gate_allows` never runs a later stage once the status is I, and :func:`lower_only` lets a later
  stage lower S/A to I but never raise anything, whatever the policy file says.

:func:`run_workflow` is the whole per-rollout logic; the I/O (cache, retries, backends, accounting) is the
`call` function it is given, so the logic is testable with no backend at all.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from eviback.metrics import answer_occurs, f1_score
from eviback.protocol import render_passages
from eviback.teacher.answers import is_non_answer
from eviback.teacher.chat import ChatMessage, ChatRequest, ReplySchema, SchemaViolation
from eviback.teacher.policy import Input, OutputField, RewardWeights, StageSpec, TeacherPolicy
from eviback.types import Passage, Question, Status, Trajectory, Verdict

NO_EVIDENCE = "(no passages were retrieved)"
NO_ANSWER = "(the agent gave no answer)"


@dataclass(frozen=True)
class SeenEvidence:
    """One search result as the actor saw it: the observation text without its `<information>` wrapper
    (cut where the rollout cut it), and the ids of the retrieved passages whose `Doc i(Title: ...)` header
    survived that cut (a passage cut away entirely was never seen)."""

    text: str
    passage_ids: tuple[str, ...] = ()


_WRAPPER_OPEN = "<information>"
_WRAPPER_CLOSE = "</information>"


def _unwrap(observation: str) -> str:
    text = observation.strip()
    if text.startswith(_WRAPPER_OPEN):
        text = text[len(_WRAPPER_OPEN):]
    close = text.rfind(_WRAPPER_CLOSE)
    if close != -1:
        text = text[:close]
    else:  # the cut may have left part of the closing tag
        for k in range(len(_WRAPPER_CLOSE) - 1, 0, -1):
            if text.endswith(_WRAPPER_CLOSE[:k]):
                text = text[:-k]
                break
    return text.strip()


def evidence_as_seen(trajectory: Trajectory) -> tuple[SeenEvidence, ...]:
    """The observations of the rollout's executed searches, as they were rendered into the actor's
    context (`Turn.observation` already holds the cut text), in order; an identical result seen twice
    (a repeated search) is kept once: it adds no evidence, only tokens."""
    out: list[SeenEvidence] = []
    texts: set[str] = set()
    for turn in trajectory.turns:
        if not turn.executed or not turn.passages:
            continue
        text = _unwrap(turn.observation)
        if not text or text in texts:
            continue
        texts.add(text)
        ids = tuple(p.id for i, p in enumerate(turn.passages, start=1) if f"Doc {i}(Title: " in text)
        out.append(SeenEvidence(text=text, passage_ids=ids))
    return tuple(out)


def render_seen(evidence: Sequence[SeenEvidence]) -> str:
    """The evidence text a stage receives: each search result as the actor saw it, one per paragraph."""
    return "\n\n".join(e.text for e in evidence)


def answer_in_evidence(answer: str | None, evidence: Sequence[SeenEvidence] | str) -> bool:
    """Whether `answer` occurs in the evidence as whole words, compared as the metrics compare answers
    (:func:`eviback.metrics.answer_occurs`): "ten" is not found in "often", "10" is not found in "ten", and
    an answer that SQuAD normalisation empties (`A+`) is looked for in its plain form, never as the empty
    string. An empty answer is never found."""
    text = evidence if isinstance(evidence, str) else render_seen(evidence)
    return answer_occurs(answer, text)


def answer_grounded(answer: str | None, evidence: Sequence[SeenEvidence] | str) -> bool:
    """The grounding rule for a refined answer: it is an answer (not a placeholder, a status label or stop
    words: :mod:`eviback.teacher.answers`) and it occurs in the evidence (:func:`answer_in_evidence`)."""
    return not is_non_answer(answer) and answer_in_evidence(answer, evidence)


def gold_in_evidence(trajectory: Trajectory) -> bool:
    """Whether a gold answer is among the evidence the rollout's actor saw (its observations as cut, whole
    words, normalised): whether the rollout could have answered from what it read."""
    text = render_seen(evidence_as_seen(trajectory))
    return any(answer_in_evidence(g, text) for g in trajectory.question.golden_answers)


@dataclass(frozen=True)
class BlindView:
    """Everything a gold-blind stage may see of a rollout. It has no field that could hold gold answers.

    `seen` is what a stage is shown: the evidence as the actor saw it. `evidence` lists the passages
    retrieved (each once), to identify them; it is not rendered (a view built by hand with `evidence`
    only renders those passages whole)."""

    question: str
    evidence: tuple[Passage, ...]
    answer: str | None
    seen: tuple[SeenEvidence, ...] = ()

    def evidence_text(self) -> str:
        if self.seen:
            return render_seen(self.seen).strip()
        return render_passages(self.evidence).strip()

    def values(self) -> dict[str, str]:
        return {
            Input.QUESTION.value: self.question.strip(),
            Input.EVIDENCE.value: self.evidence_text() or NO_EVIDENCE,
            Input.ANSWER.value: self.answer.strip() if self.answer and self.answer.strip() else NO_ANSWER,
        }


@dataclass(frozen=True)
class GoldView:
    """The reference answers, for gold-aware stages only."""

    golden_answers: tuple[str, ...]

    def render(self) -> str:
        return "; ".join(g.strip() for g in self.golden_answers)


def blind_view(trajectory: Trajectory) -> BlindView:
    """The gold-free view of a rollout: what the actor saw of its evidence (:func:`evidence_as_seen`), and
    every passage it retrieved, in order, each once (a passage retrieved twice adds no evidence)."""
    seen: set[str] = set()
    evidence = []
    for passage in trajectory.evidence:
        key = passage.id or passage.contents
        if key not in seen:
            seen.add(key)
            evidence.append(passage)
    return BlindView(question=trajectory.question.question, evidence=tuple(evidence), answer=trajectory.answer,
                     seen=evidence_as_seen(trajectory))


def reply_schema(stage: StageSpec) -> ReplySchema:
    return ReplySchema(fields=stage.outputs, statuses=stage.statuses if stage.decides_status else ())


def _render(stage: StageSpec, values: dict[str, str], sample_index: int) -> ChatRequest:
    # Only the inputs the stage sees are offered to its templates (validated when the policy was built).
    offered = {name: text for name, text in values.items() if Input(name) in stage.sees}
    messages = []
    if stage.system_prompt.strip():
        messages.append(ChatMessage("system", string.Template(stage.system_prompt).substitute(offered)))
    messages.append(ChatMessage("user", string.Template(stage.user_template).substitute(offered)))
    return ChatRequest(stage=stage.name, messages=tuple(messages), schema=reply_schema(stage),
                       decoding=stage.decoding, sample_index=sample_index)


def build_blind_request(stage: StageSpec, view: BlindView, sample_index: int = 0) -> ChatRequest:
    """The request of a gold-blind stage, built from the gold-free view alone."""
    if stage.sees_gold:
        raise ValueError(f"stage {stage.name!r} sees gold: build it with build_gold_aware_request")
    return _render(stage, view.values(), sample_index)


def build_gold_aware_request(
    stage: StageSpec, view: BlindView, gold: GoldView, sample_index: int = 0
) -> ChatRequest:
    """The request of a stage that lists `gold` in `sees`."""
    if not stage.sees_gold:
        raise ValueError(f"stage {stage.name!r} is gold-blind: build it with build_blind_request")
    return _render(stage, {**view.values(), Input.GOLD.value: gold.render()}, sample_index)


def rule_request(stage: StageSpec, view: BlindView, question: Question, sample_index: int = 0) -> ChatRequest:
    """The request of a rule stage (`eviback.teacher.rules`): no prompt, one JSON object of exactly the inputs
    the stage sees: `question` (its text), `evidence` (each search result as the actor saw it, with the ids
    of the passages seen), `answer`, and, for a gold-aware rule only, `gold` (the gold answers, and the
    data set and supporting passage ids, and titles where the data has them, that the evidence label needs)."""
    payload: dict[str, object] = {}
    if Input.QUESTION in stage.sees:
        payload["question"] = view.question
    if Input.EVIDENCE in stage.sees:
        payload["evidence"] = [{"text": e.text, "passage_ids": list(e.passage_ids)} for e in view.seen]
    if Input.ANSWER in stage.sees:
        payload["answer"] = view.answer
    if stage.sees_gold:
        payload["gold"] = {"answers": list(question.golden_answers), "dataset": question.dataset,
                           "passage_ids": list(question.gold_passage_ids)}
        if titles := question.metadata.get("supporting_titles"):  # support named by title (teacher.labels)
            payload["gold"]["supporting_titles"] = [str(t) for t in titles]
    text = json.dumps(payload, ensure_ascii=False, sort_keys=True)
    return ChatRequest(stage=stage.name, messages=(ChatMessage("user", text),), schema=reply_schema(stage),
                       decoding=stage.decoding, sample_index=sample_index)


def stage_request(stage: StageSpec, trajectory: Trajectory, sample_index: int = 0) -> ChatRequest:
    """The request for `stage` on `trajectory`: the one place where gold answers may enter a request."""
    view = blind_view(trajectory)
    if stage.is_rule:
        return rule_request(stage, view, trajectory.question, sample_index)
    if stage.sees_gold:
        return build_gold_aware_request(stage, view, GoldView(trajectory.question.golden_answers), sample_index)
    return build_blind_request(stage, view, sample_index)


# --------------------------------------------------------------------------------------------------
# Parsing replies


@dataclass(frozen=True)
class StageOutput:
    """A parsed stage reply; a field the stage does not output is None."""

    status: Status | None = None
    answer: str | None = None
    rationale: str | None = None


_STATUS_WORDS = {"s": Status.SUFFICIENT, "sufficient": Status.SUFFICIENT,
                 "i": Status.INSUFFICIENT, "insufficient": Status.INSUFFICIENT,
                 "a": Status.AMBIGUOUS, "ambiguous": Status.AMBIGUOUS}
_BARE_LABEL = re.compile(r"""^\W*(?:status\W*)?(S|I|A|sufficient|insufficient|ambiguous)["'.\s)\]}]*$""",
                         re.IGNORECASE)


def _status_of(value: object, allowed: Sequence[Status]) -> Status:
    if not isinstance(value, str):
        raise SchemaViolation(f"status must be a string label, got {type(value).__name__}")
    word = value.strip().strip("\"'.").lower()
    status = _STATUS_WORDS.get(word)
    # a one-letter label must be upper case: "a" and "i" are also ordinary words
    if status is None or (len(word) == 1 and value.strip().strip("\"'.") != status.value):
        raise SchemaViolation(f"status {value!r} is not one of {[s.value for s in allowed]}")
    if status not in allowed:
        raise SchemaViolation(f"status {status.value!r} is not allowed here (allowed: {[s.value for s in allowed]})")
    return status


def first_json_object(text: str) -> dict | None:
    """The first JSON object embedded in `text` (a reply with prose around its JSON), or None."""
    decoder = json.JSONDecoder()
    for match in re.finditer(r"\{", text):
        try:
            obj, _ = decoder.raw_decode(text, match.start())
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    return None


def parse_reply(text: str, schema: ReplySchema) -> StageOutput:
    """The stage output in `text`, or :class:`SchemaViolation`.

    Accepts the JSON object anywhere in the text (servers without structured output wrap it in prose or
    code fences); a bare status label is accepted when status is the only field that matters. Status labels
    may be spelled out ("sufficient"). A missing required field or an unknown label is a violation."""
    obj = first_json_object(text)
    if obj is None:
        needed = [f for f in schema.fields if f is not OutputField.RATIONALE]
        # a bare label only when no JSON was even attempted: a truncated object is a violation
        match = None if "{" in text else _BARE_LABEL.match(text.strip())
        if needed == [OutputField.STATUS] and match:
            return StageOutput(status=_status_of(match.group(1), schema.statuses))
        raise SchemaViolation(f"no JSON object in the reply: {text.strip()[:120]!r}")
    values: dict[str, object] = {}
    for f in schema.fields:
        if f.value not in obj:
            if f is OutputField.RATIONALE:
                continue  # a rationale is never scored; its absence is harmless
            raise SchemaViolation(f"reply lacks the field {f.value!r}: {json.dumps(obj)[:120]}")
        values[f.value] = obj[f.value]
    status = answer = rationale = None
    if OutputField.STATUS.value in values:
        status = _status_of(values[OutputField.STATUS.value], schema.statuses)
    if OutputField.ANSWER.value in values:
        raw = values[OutputField.ANSWER.value]
        if isinstance(raw, bool) or not isinstance(raw, str | int | float):
            raise SchemaViolation(f"answer must be a string, got {type(raw).__name__}")
        answer = str(raw).strip()
    if OutputField.RATIONALE.value in values:
        rationale = str(values[OutputField.RATIONALE.value])
    return StageOutput(status=status, answer=answer, rationale=rationale)


# --------------------------------------------------------------------------------------------------
# The gate, the status rule, the reward


def gate_allows(stage: StageSpec, status: Status | None) -> bool:
    """Whether a later stage runs: never after I (whatever `run_on` says), else when `status` is in run_on."""
    return status is not None and status is not Status.INSUFFICIENT and status in stage.run_on


def lower_only(current: Status, proposed: Status | None) -> Status:
    """The status after a later stage: it may lower to I; any other label keeps the current status (a
    gold-aware stage never raises a verdict, and I is never overturned)."""
    if current is Status.INSUFFICIENT:
        return current
    return Status.INSUFFICIENT if proposed is Status.INSUFFICIENT else current


def hybrid_reward(status: Status, answer: str | None, golds: Sequence[str], weights: RewardWeights) -> float:
    """`r = v[status] * F1(answer, gold)`; I gives 0 (EVIBACK.md section 4.4)."""
    if status is Status.INSUFFICIENT:
        return 0.0
    return weights.of(status) * f1_score(answer, golds)


@dataclass(frozen=True)
class StageOutcome:
    """The result of one stage request as the judge obtained it: the output or an error, and its cost.

    Token counts are those of the reply used, cached or not (the cost the policy represents); `calls` are
    the backend calls actually made (0 on a cache hit), retries included."""

    output: StageOutput | None
    error: str | None = None
    calls: int = 0
    cache_hit: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    retries: int = 0
    schema_violations: int = 0
    paid_prompt_tokens: int = 0  # every reply fetched from the backend, malformed ones included
    paid_completion_tokens: int = 0


StageCaller = Callable[[ChatRequest], StageOutcome]


def run_workflow(
    policy: TeacherPolicy, trajectory: Trajectory, call: StageCaller, sample_index: int = 0
) -> Verdict:
    """Judge one rollout: run the stages in order through the gate, ground the refined answer (when the
    policy says so: a non-answer, or an answer not found in the evidence as the actor saw it, lowers the
    status to I: :func:`answer_grounded`), then compute the hybrid reward.

    Never raises for a failed call: the verdict then has `error` set and no status or reward."""
    status: Status | None = None
    stage_a: Status | None = None
    answer = trajectory.answer
    later_ran = refined = False
    rationales: list[str] = []
    cost = dict(calls=0, prompt_tokens=0, completion_tokens=0, cache_hits=0, latency_s=0.0,
                retries=0, schema_violations=0)
    for index, stage in enumerate(policy.stages):
        if index > 0 and not gate_allows(stage, status):
            continue
        outcome = call(stage_request(stage, trajectory, sample_index))
        cost["calls"] += outcome.calls
        cost["prompt_tokens"] += outcome.prompt_tokens
        cost["completion_tokens"] += outcome.completion_tokens
        cost["cache_hits"] += int(outcome.cache_hit)
        cost["latency_s"] += outcome.latency_s
        cost["retries"] += outcome.retries
        cost["schema_violations"] += outcome.schema_violations
        if index > 0:
            later_ran = True
        if outcome.error is not None or outcome.output is None:
            return Verdict(status=None, stage_a_status=stage_a, answer=None, stage_b_ran=later_ran,
                           error=f"stage {stage.name!r}: {outcome.error or 'no output'}",
                           policy_version=policy.version, **cost)
        out = outcome.output
        if index == 0:
            status = stage_a = out.status
        else:
            assert status is not None  # the gate ran this stage, so a status exists
            status = lower_only(status, out.status)
        if out.answer is not None:
            answer, refined = out.answer, True
        if out.rationale:
            rationales.append(f"{stage.name}: {out.rationale}")
    assert status is not None  # the first stage always outputs a status (checked when the policy was built)
    ungrounded = False
    # the evidence boundary for the answer: what the evidence the actor saw does not hold earns nothing
    if (policy.grounded_answer and refined and status is not Status.INSUFFICIENT
            and not answer_grounded(answer, blind_view(trajectory).evidence_text())):
        status, ungrounded = Status.INSUFFICIENT, True
    reward = hybrid_reward(status, answer, trajectory.question.golden_answers, policy.weights)
    return Verdict(status=status, stage_a_status=stage_a, answer=answer, stage_b_ran=later_ran, reward=reward,
                   policy_version=policy.version, rationale="\n".join(rationales), ungrounded=ungrounded, **cost)
