"""The advantage math of every mode, on hand-computed groups."""

import math

import pytest

from eviback.backoff import (
    BackoffConfig,
    GroupKind,
    Mode,
    group_advantages,
    needs_teacher,
    summarize,
    zscore,
)
from eviback.types import Status, Verdict

EPS = 1e-6


def verdicts(*rewards):
    return [Verdict(Status.SUFFICIENT if r else Status.INSUFFICIENT, reward=r) for r in rewards]


def test_zscore_uses_sample_std():
    # values 0, 0, 1: mean 1/3, sample var = (1/9 + 1/9 + 4/9) / 2 = 1/3
    std = math.sqrt(1 / 3)
    assert zscore([0, 0, 1], EPS) == pytest.approx(((-1 / 3) / std, (-1 / 3) / std, (2 / 3) / std), rel=1e-5)
    assert zscore([0.5], EPS) == (0.0,)
    assert zscore([2, 2, 2], EPS) == (0.0, 0.0, 0.0)


def test_verified_group_uses_actor_rewards_and_never_the_teacher():
    config = BackoffConfig(Mode.EVIBACK, lam=0.1, eps=EPS)
    em = [1, 0, 0, 0, 1]
    assert not needs_teacher(em, config)
    out = group_advantages(em, verdicts(0.9, 0.9, 0.9, 0.9, 0.9), config)  # verdicts are ignored
    assert out.kind is GroupKind.VERIFIED
    assert out.advantages == pytest.approx(zscore(em, EPS))
    assert out.rewards == (1.0, 0.0, 0.0, 0.0, 1.0)
    assert sum(out.advantages) == pytest.approx(0.0, abs=1e-9)


def test_all_zero_group_gets_lambda_times_normalised_teacher_rewards():
    config = BackoffConfig(Mode.EVIBACK, lam=0.1, eps=EPS)
    em = [0, 0, 0, 0]
    assert needs_teacher(em, config)
    rewards = (0.0, 0.5, 1.0, 0.25)
    out = group_advantages(em, verdicts(*rewards), config)
    assert out.kind is GroupKind.FALLBACK
    mean = sum(rewards) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 3)
    assert out.advantages == pytest.approx(tuple(0.1 * (r - mean) / (std + EPS) for r in rewards))
    assert out.rewards == rewards


def test_lambda_is_applied_after_normalisation():
    em = [0, 0, 0]
    v = verdicts(0.0, 0.2, 0.6)
    a01 = group_advantages(em, v, BackoffConfig(lam=0.1)).advantages
    a1 = group_advantages(em, v, BackoffConfig(lam=1.0)).advantages
    # lambda changes the advantages (scaling the rewards before the z-score would not) ...
    assert a1 == pytest.approx(tuple(10 * a for a in a01))
    # ... and scaling the teacher rewards themselves changes nothing, since the z-score cancels it
    scaled = group_advantages(em, verdicts(0.0, 0.02, 0.06), BackoffConfig(lam=0.1)).advantages
    assert scaled == pytest.approx(a01, rel=1e-4)
    # a fallback group never contributes more than lambda times a unit-normalised signal
    verified = group_advantages([1, 0, 0], None, BackoffConfig(lam=0.1)).advantages
    assert max(map(abs, a01)) < max(map(abs, verified))


def test_lambda_zero_silences_the_teacher():
    out = group_advantages([0, 0], verdicts(0.0, 1.0), BackoffConfig(lam=0.0))
    assert out.kind is GroupKind.FALLBACK and out.advantages == (0.0, 0.0)


def test_teacher_error_falls_back_to_plain_grpo_and_is_counted():
    config = BackoffConfig()
    v = [Verdict(Status.SUFFICIENT, reward=1.0), Verdict(None, error="timeout after 3 retries")]
    out = group_advantages([0, 0], v, config)
    assert out.kind is GroupKind.TEACHER_ERROR
    assert out.advantages == (0.0, 0.0)
    assert summarize([out], config).teacher_error == 1


def test_missing_verdicts_for_a_fallback_group_is_a_bug_not_a_zero():
    with pytest.raises(ValueError, match="needs 3 verdicts, got none"):
        group_advantages([0, 0, 0], None, BackoffConfig())


def test_grpo_mode_never_uses_the_teacher():
    config = BackoffConfig(Mode.GRPO)
    assert not needs_teacher([0, 0], config)
    out = group_advantages([0, 0], verdicts(1.0, 0.0), config)
    assert out.kind is GroupKind.ALL_ZERO and out.advantages == (0.0, 0.0) and out.keep
    assert group_advantages([0, 1], None, config).advantages == pytest.approx(zscore([0, 1], config.eps))


def test_dapo_drops_zero_variance_groups():
    config = BackoffConfig(Mode.DAPO)
    for em in ([0, 0, 0], [1, 1, 1]):
        out = group_advantages(em, None, config)
        assert out.kind is GroupKind.DROPPED and not out.keep and out.advantages == (0.0,) * 3
    kept = group_advantages([1, 0, 0], None, config)
    assert kept.keep and kept.kind is GroupKind.VERIFIED


def test_summary_counts():
    config = BackoffConfig()
    outcomes = [
        group_advantages([1, 0], None, config),
        group_advantages([0, 0], verdicts(0.0, 1.0), config),
        group_advantages([0, 0], [Verdict(None, error="x"), Verdict(None, error="x")], config),
    ]
    s = summarize(outcomes, config)
    assert (s.groups, s.verified, s.all_zero, s.fallback, s.teacher_error, s.dropped) == (3, 1, 2, 1, 1, 0)
    assert s.all_zero_share == pytest.approx(2 / 3) and s.fallback_share == pytest.approx(1 / 3)


def test_informative_fallback_share_counts_only_groups_the_teacher_moved():
    config = BackoffConfig()
    outcomes = [
        group_advantages([0, 0, 0], verdicts(0.5, 0.5, 0.5), config),  # asked, but all equal: no signal
        group_advantages([0, 0, 0], verdicts(0.0, 0.0, 0.0), config),  # asked, all I: no signal
        group_advantages([0, 0, 0], verdicts(0.0, 1.0, 0.5), config),  # asked, and it moved
        group_advantages([1, 0, 0], None, config),  # verified: not a fallback
    ]
    assert [o.informative for o in outcomes] == [False, False, True, False]
    s = summarize(outcomes, config)
    assert (s.fallback, s.informative_fallback) == (3, 1)
    assert s.fallback_share == pytest.approx(3 / 4) and s.informative_fallback_share == pytest.approx(1 / 3)
    # lambda 0 still asks the teacher but its advantages are all zero: nothing is informative
    silent = summarize([group_advantages([0, 0], verdicts(0.0, 1.0), BackoffConfig(lam=0.0))], config)
    assert (silent.fallback, silent.informative_fallback) == (1, 0)
    assert summarize([], config).informative_fallback_share is None


def test_config_validation_names_the_fix():
    with pytest.raises(ValueError, match="lam must be"):
        BackoffConfig(lam=-1)
    with pytest.raises(ValueError, match="eps must be > 0"):
        BackoffConfig(eps=0)
    assert BackoffConfig(mode="dapo").mode is Mode.DAPO


# --------------------------------------------------------------------------------------------------
# The partial-credit baseline (f1-fallback): the actor's own token F1 in place of the teacher's rewards

F1_MODE = BackoffConfig(Mode.F1_FALLBACK, lam=0.1, eps=EPS)


def test_f1_fallback_gives_all_zero_groups_lambda_times_normalised_actor_f1():
    em = [0, 0, 0, 0]
    f1 = (0.0, 0.5, 0.0, 2 / 3)  # F1 of each rollout's own answer; a rollout without an answer has 0
    assert not needs_teacher(em, F1_MODE)  # no teacher in this mode
    out = group_advantages(em, None, F1_MODE, f1=f1)
    assert out.kind is GroupKind.FALLBACK and out.rewards == f1 and out.keep and out.informative
    mean = sum(f1) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in f1) / 3)
    assert out.advantages == pytest.approx(tuple(0.1 * (r - mean) / (std + EPS) for r in f1))
    # exactly the math of the teacher's fallback rewards
    teacher = group_advantages(em, verdicts(*f1), BackoffConfig(Mode.EVIBACK, lam=0.1, eps=EPS))
    assert out.advantages == pytest.approx(teacher.advantages)


def test_f1_fallback_applies_lambda_after_normalisation():
    em, f1 = [0, 0, 0], (0.0, 0.2, 0.6)
    a01 = group_advantages(em, None, F1_MODE, f1=f1).advantages
    a1 = group_advantages(em, None, BackoffConfig(Mode.F1_FALLBACK, lam=1.0, eps=EPS), f1=f1).advantages
    assert a1 == pytest.approx(tuple(10 * a for a in a01))
    assert group_advantages(em, None, F1_MODE, f1=(0.0, 0.02, 0.06)).advantages == pytest.approx(a01, rel=1e-4)


def test_f1_fallback_groups_with_a_hit_train_on_em_alone():
    em = [1, 0, 0]
    out = group_advantages(em, None, F1_MODE, f1=(1.0, 0.8, 0.0))  # the F1 values are ignored
    assert out.kind is GroupKind.VERIFIED and out.rewards == (1.0, 0.0, 0.0)
    assert out.advantages == pytest.approx(zscore(em, EPS))


def test_f1_fallback_equal_f1_gives_no_signal_and_missing_f1_is_a_bug():
    out = group_advantages([0, 0, 0], None, F1_MODE, f1=(0.0, 0.0, 0.0))  # nobody answered anything close
    assert out.kind is GroupKind.FALLBACK and out.advantages == (0.0, 0.0, 0.0) and not out.informative
    with pytest.raises(ValueError, match="needs 3 F1 values in f1-fallback mode, got none"):
        group_advantages([0, 0, 0], None, F1_MODE)
    with pytest.raises(ValueError, match="got 2"):
        group_advantages([0, 0, 0], None, F1_MODE, f1=(0.1, 0.2))
    # the other modes ignore F1
    assert group_advantages([0, 0], None, BackoffConfig(Mode.GRPO), f1=(0.0, 1.0)).advantages == (0.0, 0.0)


def test_f1_fallback_summary_counts_fallback_and_informative_groups():
    outcomes = [
        group_advantages([1, 0], None, F1_MODE, f1=(1.0, 0.0)),
        group_advantages([0, 0], None, F1_MODE, f1=(0.0, 0.5)),
        group_advantages([0, 0], None, F1_MODE, f1=(0.5, 0.5)),
    ]
    s = summarize(outcomes, F1_MODE)
    assert (s.groups, s.verified, s.all_zero, s.fallback, s.informative_fallback) == (3, 1, 2, 2, 1)
    assert s.informative_fallback_share == pytest.approx(0.5)
