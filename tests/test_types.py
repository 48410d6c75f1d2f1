"""Records serialise to JSON and back unchanged."""

import json

import pytest

from eviback.types import (
    Action,
    ActionKind,
    Group,
    Passage,
    Question,
    Status,
    StopReason,
    TokenTrace,
    Trajectory,
    Turn,
    Verdict,
    from_dict,
    to_dict,
)


def test_trajectory_round_trip_through_json():
    q = Question("q", "who?", ("a", "b"), "nq", "dev", {"gold_passage_ids": ["1"]})
    p = Passage("1", '"T"\ntext', 1.5)
    t = Trajectory(
        question=q,
        turns=(Turn("<search>x</search>", Action(ActionKind.SEARCH, "x"), (p,), "\n\n<information>..", True),
               Turn("<answer>a</answer>", Action(ActionKind.ANSWER, "a"))),
        answer="a", stop_reason=StopReason.ANSWERED, sample_index=2,
        tokens=TokenTrace((1, 2), (3, 4, 5), (1, 0, 1), (-0.5, 0.0, -1.0)),
    )
    back = from_dict(Trajectory, json.loads(json.dumps(to_dict(t))))
    assert back == t
    assert back.evidence == (p,) and back.queries == ("x",)
    g = Group(q, (t, t))
    assert from_dict(Group, to_dict(g)) == g


def test_verdict_round_trip_and_error_flag():
    v = Verdict(Status.AMBIGUOUS, Status.SUFFICIENT, "Paris", True, 0.5)
    assert from_dict(Verdict, to_dict(v)) == v
    assert to_dict(v)["status"] == "A"
    assert Verdict(None, error="timeout").teacher_error


def test_missing_field_is_named():
    with pytest.raises(ValueError, match="Question: missing field 'golden_answers'"):
        from_dict(Question, {"id": "x", "question": "y"})
