"""The per-rollout teacher logic: gate, I never overturned, reward, parsing, and the evidence boundary."""

import dataclasses
import inspect

import pytest

from eviback.protocol import render_observation
from eviback.teacher.boundary import CanaryAudit, plant_canaries
from eviback.teacher.cache import MemoryCache
from eviback.teacher.chat import ReplySchema, SchemaViolation
from eviback.teacher.judge import JudgeConfig, Teacher
from eviback.teacher.policy import OutputField, RewardWeights, load_policy
from eviback.teacher.probes import build_probes
from eviback.teacher.workflow import (
    BlindView,
    SeenEvidence,
    StageOutcome,
    StageOutput,
    blind_view,
    build_blind_request,
    gate_allows,
    hybrid_reward,
    lower_only,
    parse_reply,
    run_workflow,
)
from eviback.types import Action, ActionKind, Passage, Question, Status, StopReason, Trajectory, Turn
from teacher_fakes import ScriptedClient, default_reply

S, I, A = Status.SUFFICIENT, Status.INSUFFICIENT, Status.AMBIGUOUS  # noqa: E741 - the method's labels
TWO = load_policy("two-stage")
SINGLE = load_policy("single-prompt-dual-task")


def rollout(golds=("Paris",), answer="Lyon", passages=None):
    passages = passages or (Passage("1", '"France"\nParis is the capital of France.'),)
    question = Question("q1", "What is the capital of France?", tuple(golds), metadata={"note": golds[0]})
    turns = (Turn("<search> capital of France </search>", Action(ActionKind.SEARCH, "capital of France"),
                  passages, render_observation(passages), True),
             Turn(f"<answer> {answer} </answer>", Action(ActionKind.ANSWER, answer or "")))
    return Trajectory(question, turns, answer, StopReason.ANSWERED)


def scripted(stage_a, stage_b=("S", "Paris")):
    """A caller returning fixed outputs per stage, recording which stages ran."""
    ran = []

    def call(request):
        ran.append(request.stage)
        if request.stage == "A":
            return StageOutcome(StageOutput(status=Status(stage_a)), calls=1)
        status, answer = stage_b
        return StageOutcome(StageOutput(status=Status(status), answer=answer), calls=1)
    return call, ran


@pytest.mark.parametrize("stage_a, stage_b, final, ran_b, reward", [
    ("S", ("S", "Paris"), S, True, 1.0),
    ("A", ("S", "Paris"), A, True, 0.5),  # B cannot raise A to S
    ("S", ("I", "Paris"), I, True, 0.0),  # B may lower S to I
    ("A", ("I", "Paris"), I, True, 0.0),
    ("I", ("S", "Paris"), I, False, 0.0),  # B never runs after I, so I is never overturned
])
def test_gate_and_status_rule(stage_a, stage_b, final, ran_b, reward):
    call, ran = scripted(stage_a, stage_b)
    verdict = run_workflow(TWO, rollout(), call)
    assert verdict.status is final and verdict.stage_a_status is Status(stage_a)
    assert verdict.stage_b_ran is ran_b and ran == (["A", "B"] if ran_b else ["A"])
    assert verdict.reward == pytest.approx(reward)
    assert verdict.answer == ("Paris" if ran_b else "Lyon")  # the actor's answer when B did not run
    assert verdict.calls == len(ran) and verdict.policy_version == TWO.version


def test_i_is_final_whatever_the_gate_or_the_stage_says():
    later = TWO.stages[1]
    for status in (I, None):
        assert not gate_allows(later, status)
    for proposed in (S, A, I, None):
        assert lower_only(I, proposed) is I
    assert lower_only(A, S) is A and lower_only(S, A) is S and lower_only(S, I) is I


def test_hybrid_reward():
    w = RewardWeights()
    assert hybrid_reward(S, "Paris", ["Paris"], w) == 1.0
    assert hybrid_reward(A, "Paris", ["Paris"], w) == 0.5
    assert hybrid_reward(I, "Paris", ["Paris"], w) == 0.0
    assert hybrid_reward(S, "the city of Paris", ["Paris"], w) == pytest.approx(0.5)  # F1 2*(1/3*1)/(4/3)
    assert hybrid_reward(S, None, ["Paris"], w) == 0.0
    assert hybrid_reward(A, "Paris France", ["Paris"], RewardWeights(ambiguous=0.2)) == pytest.approx(0.2 * 2 / 3)


def test_a_failed_stage_is_a_teacher_error_not_a_zero():
    def call(request):
        if request.stage == "A":
            return StageOutcome(StageOutput(status=S), calls=1)
        return StageOutcome(None, error="HTTP 500", calls=3, retries=2)
    verdict = run_workflow(TWO, rollout(), call)
    assert verdict.teacher_error and verdict.status is None and verdict.reward is None
    assert "stage 'B'" in verdict.error and verdict.calls == 4 and verdict.retries == 2
    assert verdict.stage_a_status is S


def test_single_prompt_baseline_outputs_status_and_answer_at_once():
    def call(request):
        assert request.stage == "judge"
        return StageOutcome(StageOutput(status=A, answer="Paris"), calls=1)
    verdict = run_workflow(SINGLE, rollout(), call)
    assert (verdict.status, verdict.answer, verdict.reward, verdict.stage_b_ran) == (A, "Paris", 0.5, False)


# --------------------------------------------------------------------------------------------------
# Parsing

STATUS_ONLY = ReplySchema((OutputField.STATUS,), (S, A, I))
STATUS_ANSWER = ReplySchema((OutputField.STATUS, OutputField.ANSWER), (S, I))


@pytest.mark.parametrize("text, expected", [
    ('{"status": "S"}', S),
    ('```json\n{"status": "A"}\n```', A),
    ('Sure! Here it is: {"status": "I"} Hope this helps {"x": 1}', I),
    ('{"status": "sufficient"}', S),
    ("S", S),
    ('"I".', I),
    ("Status: A", A),
    ("Insufficient", I),
])
def test_parse_accepts_json_anywhere_and_bare_labels(text, expected):
    assert parse_reply(text, STATUS_ONLY).status is expected


@pytest.mark.parametrize("schema, text", [
    (STATUS_ONLY, "The evidence seems fine to me."),
    (STATUS_ONLY, '{"status": "X"}'),
    (STATUS_ONLY, '{"verdict": "S"}'),
    (STATUS_ONLY, "a"),  # lower-case one-letter labels are ordinary words
    (STATUS_ANSWER, '{"status": "A", "answer": "x"}'),  # A is not allowed in this stage
    (STATUS_ANSWER, '{"status": "S"}'),  # missing answer
    (STATUS_ANSWER, "S"),  # a bare label cannot carry the answer
    (STATUS_ANSWER, '{"status": "S", "answer": ["x"]}'),
    (STATUS_ONLY, '{"status": "S"'),  # truncated
])
def test_parse_rejects_what_does_not_fit_the_schema(schema, text):
    with pytest.raises(SchemaViolation):
        parse_reply(text, schema)


def test_parse_answer_field():
    out = parse_reply('{"status": "S", "answer": " Paris ", "extra": 1}', STATUS_ANSWER)
    assert out == StageOutput(status=S, answer="Paris")
    assert parse_reply('{"status": "S", "answer": 1969}', STATUS_ANSWER).answer == "1969"


# --------------------------------------------------------------------------------------------------
# The evidence boundary, by construction and by canaries


def test_the_stage_a_builder_cannot_receive_gold():
    params = inspect.signature(build_blind_request).parameters
    assert list(params) == ["stage", "view", "sample_index"]
    assert {f for f in BlindView.__dataclass_fields__} == {"question", "evidence", "answer", "seen"}
    assert {f for f in SeenEvidence.__dataclass_fields__} == {"text", "passage_ids"}
    view = blind_view(rollout(golds=("GOLDCANARY",)))
    assert "GOLDCANARY" not in repr(view)
    with pytest.raises(ValueError, match="sees gold"):
        build_blind_request(TWO.stages[1], view)


def test_no_byte_of_any_stage_a_request_contains_a_gold_canary():
    """Canaries planted in the gold answers (and the question's id and metadata) of many real-data rollouts
    never reach a Stage A request of the two-stage policy, through the whole judging machinery (cache
    included); they do reach every Stage B request and every request of the single-prompt baseline
    (positive controls: the audit can see a leak)."""
    planted, canaries = plant_canaries([p.trajectory for p in build_probes(120, seed=3)], seed=7)

    def script(request):  # S / A from Stage A, so that Stage B runs
        status = "S" if request.stage != "A" or len(request.canonical_json()) % 2 else "A"
        return default_reply(request, status=status, answer="x")

    for policy in (TWO, SINGLE):
        audit = CanaryAudit(policy, canaries)
        client = ScriptedClient(script)
        with Teacher(policy, client, JudgeConfig(concurrency=4), cache=MemoryCache(), on_request=audit) as teacher:
            verdicts = teacher.judge(planted)
            teacher.judge(planted)  # again, from the cache: still audited
        assert not any(v.teacher_error for v in verdicts)
        assert audit.checked == 2 * len(planted)
        if policy is SINGLE:
            assert len({leak.canary for leak in audit.leaks}) == len(canaries)
            continue
        assert audit.leaks == []
        # an independent byte-level check of what the backend received, and the positive control
        for request in client.requests:
            data = request.canonical_json().encode()
            hits = [c for c in canaries if c.encode() in data]
            assert (request.stage == "B") == bool(hits), request.stage
        assert {v.stage_a_status for v in verdicts} == {S, A} and all(v.stage_b_ran for v in verdicts)


def test_injection_goes_into_the_evidence_as_the_actor_saw_it():
    """A rollout whose observation was cut: the injected instruction follows the text the actor saw of the
    passage, and the rest of the observation stays cut (never the full passages re-rendered)."""
    from eviback.teacher.probes import build_probes, inject
    checked = 0
    for probe in build_probes(12, seed=3, source="train"):
        t = probe.trajectory
        full = t.turns[0].observation
        cut_turn = dataclasses.replace(t.turns[0], observation=full[: len(full) // 2])
        cut = dataclasses.replace(t, turns=(cut_turn,) + t.turns[1:])
        before = blind_view(cut).evidence_text()
        for passage in (0, 1):
            if f"Doc {passage + 1}(Title: " not in before:
                with pytest.raises(ValueError, match="never saw"):
                    inject(cut, "OBEY.", passage=passage)
                continue
            after = blind_view(inject(cut, "OBEY.", passage=passage)).evidence_text()
            checked += 1
            assert after.count("OBEY.") == 1 and len(after) <= len(before) + len("  OBEY.")
            assert " ".join(after.replace("OBEY.", "").split()) == " ".join(before.split())
    assert checked >= 12
