"""Within-group diversity of the all-zero groups (could a group carry a signal?), and its step metrics."""

import pytest

from eviback.protocol import render_observation
from eviback.train.diversity import GroupDiversity, diversity_metrics, group_diversity
from eviback.types import (
    Action,
    ActionKind,
    Group,
    Passage,
    Question,
    Status,
    StopReason,
    Trajectory,
    Turn,
    Verdict,
)

S, I, A = Status.SUFFICIENT, Status.INSUFFICIENT, Status.AMBIGUOUS  # noqa: E741 - the method's labels
Q = Question("q", "When was the Eiffel Tower completed?", ("1889",))
P1 = Passage("p1", '"Eiffel Tower"\nThe Eiffel Tower was completed in 1889.')
P2 = Passage("p2", '"Louvre"\nThe Louvre is a museum in Paris.')
P3 = Passage("p3", '"Paris"\nParis is the capital of France.')


def rollout(*searches, answer="1900", cut=None, index=0):
    """A rollout with one executed search per (query, passages); `cut` keeps that many characters of each
    observation (what the actor saw)."""
    turns = []
    for query, passages in searches:
        obs = render_observation(passages)
        turns.append(Turn(f"<search> {query} </search>", Action(ActionKind.SEARCH, query), passages,
                          obs[:cut] if cut else obs, True))
    turns.append(Turn(f"<answer> {answer} </answer>", Action(ActionKind.ANSWER, answer)))
    return Trajectory(Q, tuple(turns), answer, StopReason.ANSWERED, sample_index=index)


def test_distinct_queries_evidence_rewards_and_statuses_of_a_group():
    group = Group(Q, (
        rollout(("Eiffel Tower", (P1, P2))),
        rollout(("eiffel tower?", (P2, P1))),  # the same query normalised, the same passages in another order
        rollout(("Louvre", (P2, P3))),
        rollout(),  # no search at all
    ))
    verdicts = [Verdict(S, reward=1.0), Verdict(S, reward=1.0), Verdict(I, reward=0.0), Verdict(I, reward=0.0)]
    d = group_diversity(group, [1.0, 1.0, 0.0, 0.0], verdicts)
    # labels: the first two saw the answer (S), the last two did not (I)
    assert d == GroupDiversity(rollouts=4, queries=3, evidence=3, rewards=2, statuses=2, labels=2)


def test_a_group_of_identical_rollouts_has_one_of_everything():
    group = Group(Q, tuple(rollout(("Eiffel Tower", (P1,)), index=i) for i in range(3)))
    d = group_diversity(group, [0.0, 0.0, 0.0])
    assert (d.queries, d.evidence, d.rewards, d.statuses) == (1, 1, 1, None)  # not judged: no statuses


def test_evidence_is_what_the_actor_saw():
    full = render_observation((P1, P2))
    cut = full.index("Doc 2(")  # the second passage was cut away entirely: never seen
    group = Group(Q, (rollout(("Eiffel Tower", (P1, P2))), rollout(("Eiffel Tower", (P1, P2)), cut=cut)))
    assert group_diversity(group, [0.0, 0.0]).evidence == 2


def test_statuses_only_for_groups_judged_without_error():
    group = Group(Q, (rollout(("a", (P1,))), rollout(("b", (P2,)))))
    failed = [Verdict(S, reward=1.0), Verdict(None, error="timeout")]
    assert group_diversity(group, [0.0, 0.0], failed).statuses is None
    with pytest.raises(ValueError, match="3 rewards for a group of 2"):
        group_diversity(group, [0.0, 0.0, 0.0])


def test_step_metrics_average_over_the_all_zero_groups():
    metrics = diversity_metrics([GroupDiversity(5, 1, 2, 1, 1, 1), GroupDiversity(5, 3, 4, 2, None, 2)])
    assert metrics == {"backoff/all_zero_distinct_queries": 2.0, "backoff/all_zero_distinct_evidence": 3.0,
                       "backoff/all_zero_distinct_rewards": 1.5, "backoff/all_zero_distinct_statuses": 1.0,
                       "backoff/all_zero_distinct_labels": 1.5}
    assert set(diversity_metrics([]).values()) == {None}


def test_a_step_logs_the_diversity_of_its_all_zero_groups_next_to_the_informative_share():
    from eviback.backoff import BackoffConfig, Mode, group_advantages
    from eviback.rollout import RolloutBatch
    from eviback.train.step_records import StepOutcome, step_metrics

    verified = Group(Q, (rollout(("Eiffel Tower", (P1,)), answer="1889"), rollout(("Louvre", (P2,)))))
    same = Group(Q, (rollout(("Eiffel Tower", (P1,))), rollout(("Eiffel Tower", (P1,)), index=1)))
    varied = Group(Q, (rollout(("Eiffel Tower", (P1,)), answer="1889 or 1890"), rollout(("Louvre", (P2,)))))
    config = BackoffConfig(Mode.F1_FALLBACK)
    outcomes = (group_advantages([1, 0], None, config, f1=[1.0, 0.0]),
                group_advantages([0, 0], None, config, f1=[0.0, 0.0]),
                group_advantages([0, 0], None, config, f1=[0.5, 0.0]))
    outcome = StepOutcome(step=1, batch=RolloutBatch((verified, same, varied), (), 1.0), outcomes=outcomes,
                          verdicts=(None, None, None), teacher_s=0.0, sync_s=0.0)
    record = step_metrics(outcome, config)
    assert record["backoff/informative_fallback_share"] == 0.5
    assert record["backoff/all_zero_distinct_queries"] == 1.5  # 1 in `same`, 2 in `varied`; `verified` left out
    assert record["backoff/all_zero_distinct_evidence"] == 1.5
    assert record["backoff/all_zero_distinct_rewards"] == 1.5
    assert record["backoff/all_zero_distinct_statuses"] is None  # no teacher in f1-fallback
    assert record["backoff/fallback_reward_mean"] == pytest.approx(0.125) and record["teacher/reward_mean"] is None


def test_a_step_counts_stage_a_as_a_gate_against_the_evidence_labels():
    """Stage A's verdicts on the judged rollouts, against what the rollouts saw: I evidence closed, S/A open."""
    from eviback.backoff import BackoffConfig, group_advantages
    from eviback.rollout import RolloutBatch
    from eviback.train.step_records import StepOutcome, step_metrics

    group = Group(Q, (rollout(("Eiffel Tower", (P1,))), rollout(("Louvre", (P2,)), index=1),
                      rollout(("Paris", (P3,)), index=2)))  # S, I, I evidence; all answer 1900 (EM 0)
    verdicts = (Verdict(S, stage_a_status=S, reward=0.0), Verdict(I, stage_a_status=I, reward=0.0),
                Verdict(S, stage_a_status=A, reward=0.0))  # the third: I evidence let through
    config = BackoffConfig()
    outcome = StepOutcome(step=1, batch=RolloutBatch((group,), (), 1.0),
                          outcomes=(group_advantages([0, 0, 0], verdicts, config),), verdicts=(verdicts,),
                          teacher_s=0.0, sync_s=0.0)
    record = step_metrics(outcome, config)
    assert (record["teacher/gate_label_i"], record["teacher/gate_closed_on_i"]) == (2, 1)
    assert (record["teacher/gate_label_open"], record["teacher/gate_open_on_open"]) == (1, 1)
    assert record["backoff/all_zero_distinct_labels"] == 2.0
    # the labels are computed once per step and kept with the group, texts or not
    from eviback.train.step_records import compact_group_record, group_records

    assert outcome.labels == ((S, I, I),)
    assert compact_group_record(group_records(outcome)[0])["labels"] == ["S", "I", "I"]


def test_the_update_counts_the_tokens_of_the_kept_rollouts_only():
    """`train/update_tokens` and `train/scored_tokens`: each kept rollout's prompt + response, and its model
    tokens; a dropped group (DAPO) adds nothing, and a step without an update counts 0."""
    import dataclasses

    from eviback.backoff import GroupAdvantages, GroupKind
    from eviback.rollout import RolloutBatch
    from eviback.train.step_records import StepOutcome, update_tokens
    from eviback.types import TokenTrace

    def traced(prompt: int, mask: tuple[int, ...]):
        trace = TokenTrace(prompt_ids=(1,) * prompt, ids=tuple(range(len(mask))), mask=mask)
        return dataclasses.replace(rollout(), tokens=trace)

    kept = Group(Q, (traced(10, (1, 1, 0, 0, 1)), traced(10, (1, 1, 1))))
    dropped = Group(Q, (traced(10, (1,) * 7), traced(10, (1,) * 7)))
    outcomes = (GroupAdvantages(GroupKind.VERIFIED, (1.0, 0.0), (1.0, 0.0), (0.7, -0.7)),
                GroupAdvantages(GroupKind.VERIFIED, (1.0, 1.0), (1.0, 1.0), (0.0, 0.0), keep=False))
    outcome = StepOutcome(step=1, batch=RolloutBatch((kept, dropped), (), 1.0), outcomes=outcomes,
                          verdicts=(None, None), teacher_s=0.0, sync_s=0.0)
    assert update_tokens(outcome) == {"train/update_tokens": 10 + 5 + 10 + 3, "train/scored_tokens": 3 + 3}
    skipped = dataclasses.replace(outcome, update_skipped=True)
    assert update_tokens(skipped) == {"train/update_tokens": 0, "train/scored_tokens": 0}
