"""Answer metrics on hand-computed cases, and trajectory statistics."""

import pytest

from eviback.metrics import (
    answer_key,
    answer_occurs,
    exact_match,
    f1_score,
    normalize_answer,
    rollout_metrics,
    sub_exact_match,
    trajectory_stats,
)
from eviback.types import Action, ActionKind, Question, StopReason, Trajectory, Turn


def test_normalize_answer():
    assert normalize_answer("  The  Eiffel-Tower, an icon! ") == "eiffeltower icon"
    assert normalize_answer("A cat and THE dog") == "cat and dog"
    assert normalize_answer("theory") == "theory"  # articles only as whole words


def test_exact_match_max_over_golds():
    assert exact_match("the Beatles", ["Rolling Stones", "Beatles"]) == 1.0
    assert exact_match("Beatles band", ["Beatles"]) == 0.0
    assert exact_match(None, ["x"]) == 0.0


def test_sub_exact_match():
    assert sub_exact_match("it was the Beatles band", ["Beatles"]) == 1.0
    assert sub_exact_match("Stones", ["Rolling Stones"]) == 0.0
    assert sub_exact_match(None, ["x"]) == 0.0


def test_f1_hand_computed():
    # pred "barack obama president" vs gold "barack obama": p = 2/3, r = 1, f1 = 0.8
    assert f1_score("Barack Obama, president", ["Barack Obama"]) == pytest.approx(0.8)
    # max over golds: vs "obama" p = 1/3, r = 1 -> 0.5; vs "president obama" p = 2/3 r = 1 -> 0.8
    assert f1_score("barack obama president", ["obama", "president obama"]) == pytest.approx(0.8)
    # repeated tokens count with multiplicity: "a a b" (articles dropped: "b")... use plain tokens
    assert f1_score("new new york", ["new york"]) == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))
    assert f1_score("Paris", ["London"]) == 0.0
    assert f1_score(None, ["x"]) == 0.0


def test_f1_yes_no_rule():
    assert f1_score("yes", ["no"]) == 0.0
    assert f1_score("yes it is", ["yes"]) == 0.0  # gold is special and differs
    assert f1_score("no", ["no"]) == 1.0
    assert f1_score("yes", ["no", "yes"]) == 1.0


# Golds that SQuAD normalisation empties, as found in the data releases (nq, hotpotqa): `A+` (a blood
# type), `The The` and `!!!` (bands), `*` (a symbol), and stray `)` / `---`.
EMPTIED_GOLDS = ("A+", "The The", "!!!", "*", ")", "---")


@pytest.mark.parametrize("gold", EMPTIED_GOLDS)
def test_a_gold_that_squad_empties_matches_only_itself(gold):
    assert normalize_answer(gold) == ""  # the case at hand
    for metric in (exact_match, sub_exact_match, f1_score):
        assert metric(gold, [gold]) == 1.0, metric.__name__
        assert metric(gold.lower(), [gold]) == 1.0, metric.__name__
        for other in ("...", "", " ", "Paris", "a"):
            assert metric(other, [gold]) == 0.0, (metric.__name__, other)
    assert exact_match("the", [gold]) == 0.0 and sub_exact_match("the", [gold]) == 0.0


def test_a_gold_that_squad_empties_gets_partial_f1_like_any_other():
    assert f1_score("the", ["The The"]) == pytest.approx(2 / 3)  # one of its two words


def test_punctuation_only_answers_do_not_match_each_other():
    assert exact_match("...", ["*"]) == 0.0  # both used to normalise to "", which made them equal
    assert exact_match("A", ["A+"]) == 0.0 and exact_match("A-", ["A+"]) == 0.0
    assert sub_exact_match("Paris is the capital", ["*"]) == 0.0  # "" used to be in every prediction
    assert sub_exact_match("a saltire", ["*"]) == 0.0
    assert f1_score("...", ["*"]) == 0.0
    # the question of the issue (nq test_1986): its other golds still score as before
    golds = ["a rotationally symmetric saltire", "the symbol ×", "*"]
    assert exact_match("...", golds) == 0.0 and sub_exact_match("...", golds) == 0.0
    assert exact_match("the symbol ×", golds) == 1.0 and exact_match("*", golds) == 1.0


def test_a_gold_that_squad_empties_is_found_as_whole_words():
    assert sub_exact_match("The blood type is A+.", ["A+"]) == 1.0
    assert sub_exact_match("blood type AB+", ["A+"]) == 0.0  # not inside a word
    assert sub_exact_match("2 * 3", ["*"]) == 1.0
    assert sub_exact_match("2*3", ["*"]) == 0.0
    assert sub_exact_match("the band The The", ["The The"]) == 1.0
    assert f1_score("blood type A+", ["A+"]) == pytest.approx(0.5)  # plain tokens: blood, type, a+
    assert f1_score("blood type AB+", ["A+", "AB+"]) == pytest.approx(0.5)  # AB+ keeps its SQuAD form "ab"


def test_a_blank_gold_never_matches():
    for prediction in ("", " ", "...", "Paris"):
        for metric in (exact_match, sub_exact_match, f1_score):
            assert metric(prediction, ["", " "]) == 0.0, (metric.__name__, prediction)


@pytest.mark.parametrize("a", ["A+", "a+", "A", "...", "*", "The The", "the", "Paris", "the Paris", ""])
@pytest.mark.parametrize("b", ["A+", "a +", "...", "*", "The The", "Paris", " the  paris ", "!!!"])
def test_equal_keys_mean_exact_match(a, b):
    assert (answer_key(a) == answer_key(b) and answer_key(b) != "") == (exact_match(a, [b]) == 1.0)
    assert sub_exact_match(a, [b]) >= exact_match(a, [b])


@pytest.mark.parametrize("answer, text, found", [
    ("A+", "patients with type A+ blood", True),
    ("A+", "patients with type AB+ blood", False),
    ("*", "written 2*3", False),
    ("...", "a passage cut here ...", True),  # a plain answer is found as itself, nothing more
    ("...", "a passage with no dots", False),
    ("", "anything", False),
    (None, "anything", False),
])
def test_answer_occurs(answer, text, found):
    assert answer_occurs(answer, text) is found


def _trajectory(queries, answer, stop=StopReason.ANSWERED, golds=("Paris",)):
    turns = [Turn(f"<search>{q}</search>", Action(ActionKind.SEARCH, q), executed=True) for q in queries]
    if answer is not None:
        turns.append(Turn(f"<answer>{answer}</answer>", Action(ActionKind.ANSWER, answer)))
    q = Question("q1", "capital of France?", tuple(golds))
    return Trajectory(q, tuple(turns), answer, stop)


def test_trajectory_stats_duplicates_use_normalised_queries():
    stats = trajectory_stats(_trajectory(["Capital of France", "capital of france!", "the capital of France", "x"], "Paris"))
    assert stats.searches == 4
    assert stats.duplicate_searches == 2
    assert stats.valid_answer and not stats.forced


def test_unexecuted_final_search_is_not_counted():
    q = Question("q", "?", ("a",))
    turns = (
        Turn("<search>a</search>", Action(ActionKind.SEARCH, "a"), executed=True),
        Turn("<search>a</search>", Action(ActionKind.SEARCH, "a"), executed=False),
    )
    stats = trajectory_stats(Trajectory(q, turns, None, StopReason.FORCED))
    assert stats.searches == 1 and stats.duplicate_searches == 0
    assert stats.forced and not stats.valid_answer


def test_rollout_metrics_means():
    m = rollout_metrics([
        _trajectory(["a", "a"], "Paris"),
        _trajectory(["b"], None, StopReason.FORCED),
    ])
    assert m.n == 2
    assert m.em == 0.5 and m.f1 == 0.5
    assert m.valid_answer_rate == 0.5
    assert m.avg_searches == 1.5
    assert m.duplicate_query_rate == pytest.approx(1 / 3)
    assert m.forced_termination_rate == 0.5
    assert rollout_metrics([]).n == 0


@pytest.mark.parametrize("answer, stop, valid, forced", [
    ("Paris", StopReason.ANSWERED, True, False),
    ("", StopReason.ANSWERED, False, False),  # `<answer></answer>`: parseable but empty
    (" ... ", StopReason.ANSWERED, False, False),  # no letter or digit: says nothing
    ("1889", StopReason.ANSWERED, True, False),
    (None, StopReason.FORCED, False, True),  # cut at the turn limit
    (None, StopReason.LENGTH, False, False),  # cut by the context budget: not the turn limit
])
def test_valid_answer_and_forced_termination_each_say_something(answer, stop, valid, forced):
    stats = trajectory_stats(_trajectory(["x"], answer, stop))
    assert (stats.valid_answer, stats.forced) == (valid, forced)


def test_valid_answer_and_forced_rates_are_not_complements():
    m = rollout_metrics([_trajectory(["a"], "Paris"), _trajectory(["b"], "", StopReason.ANSWERED),
                         _trajectory(["c"], None, StopReason.LENGTH), _trajectory(["d"], None, StopReason.FORCED)])
    assert m.valid_answer_rate == 0.25 and m.forced_termination_rate == 0.25
