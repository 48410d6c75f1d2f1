"""Observations split at their passages' headers and joined back, byte for byte, wherever the cut fell."""

from eviback.protocol import join_observation, render_observation, split_observation
from eviback.teacher.workflow import evidence_as_seen
from eviback.types import Action, ActionKind, Passage, Question, StopReason, Trajectory, Turn

PASSAGES = tuple(Passage(id=str(i), contents=f'"Title {i}"\nline one of {i}\nline two') for i in range(3))


def test_split_and_join_round_trip_at_every_cut():
    full = render_observation(PASSAGES)
    for k in range(len(full) + 1):
        observation = full[:k]
        parts = split_observation(observation, len(PASSAGES))
        assert join_observation(parts) == observation
        turn = Turn("<search> q </search>", Action(ActionKind.SEARCH, "q"), PASSAGES, observation, executed=True)
        seen = evidence_as_seen(Trajectory(Question("q1", "q?", ("a",)), (turn,), None, StopReason.FORCED))
        assert len(parts.docs) == (len(seen[0].passage_ids) if seen else 0)


def test_docs_are_the_passages_as_seen():
    full = render_observation(PASSAGES)
    parts = split_observation(full, 3)
    assert parts.head == "\n\n<information>" and parts.tail == "</information>\n\n"
    assert parts.docs[1] == '"Title 1") line one of 1\nline two'
    cut = split_observation(full[: full.index("Doc 3(Title") + 5], 3)
    assert len(cut.docs) == 2 and cut.tail == "\nDoc 3"
