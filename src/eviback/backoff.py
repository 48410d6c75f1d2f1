"""Evidence-constrained teacher backoff: rewards and advantages, as pure functions.

Numbers in, numbers out; no model, no trainer, no I/O. The training adapter calls these and never
re-derives the math (EVIBACK.md section 4):

1. **Actor-first precedence.** A group with a verified hit (EM = 1 for some rollout) trains on its actor
   rewards, `A = (EM - mean) / (std + eps)`; the teacher is not consulted.
2. **Selective fallback.** Only an all-zero group asks the teacher; its hybrid rewards `r` are normalised in
   the group and *then* scaled: `A = lam * (r - mean) / (std + eps)`. Scaling after normalisation matters:
   scaling `r` before a z-score would cancel out.
3. **Failures degrade deliberately.** If any verdict of a fallback group is a teacher error, the group falls
   back to plain GRPO (advantage 0 for an all-zero group) and is counted; it is never scored as 0 reward.

`std` is the sample standard deviation (Bessel-corrected, as TRL and verl compute it); a group of one has
std 0. Modes reproduce the baselines: plain GRPO (`grpo`), DAPO-style filtering of zero-variance groups
(`dapo`), EviBack (`eviback`) with any teacher policy and any lambda, and the partial-credit baseline
(`f1-fallback`): an all-zero group's rewards are each rollout's own token F1 against the gold (no answer: 0),
normalised and scaled exactly like the teacher's, `A = lam * (f1 - mean) / (std + eps)`; no teacher. A
teacher has to beat it to be worth its cost.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from eviback.settings import check_fields
from eviback.types import Verdict


class Mode(enum.StrEnum):
    GRPO = "grpo"  # actor rewards only; all-zero groups get advantage 0
    DAPO = "dapo"  # actor rewards; zero-variance groups are dropped from the loss
    EVIBACK = "eviback"  # actor rewards, teacher rewards for all-zero groups
    F1_FALLBACK = "f1-fallback"  # actor rewards; all-zero groups get the actor's own token F1 (no teacher)


class GroupKind(enum.StrEnum):
    """How a group's advantages were obtained."""

    VERIFIED = "verified"  # at least one verified hit: actor rewards
    ALL_ZERO = "all_zero"  # no hit, no teacher (grpo mode): advantage 0
    FALLBACK = "fallback"  # no hit: fallback rewards (the teacher's, or the actor's own F1) x lambda
    TEACHER_ERROR = "teacher_error"  # no hit, teacher failed on some rollout: advantage 0, counted
    DROPPED = "dropped"  # dapo: zero-variance group removed from the loss


@dataclass(frozen=True)
class BackoffConfig:
    """How advantages are computed.

    Attributes:
        mode: `grpo`, `dapo`, `eviback` or `f1-fallback`.
        lam: lambda, the scale of fallback advantages (teacher or F1 rewards; applied after normalisation). 0
            disables their effect (the teacher is still called); EVIBACK.md uses 0.1.
        eps: added to the group std before dividing.
        hit_threshold: a rollout is a verified hit when its EM is at least this (EM is 0/1, so 1.0).
    """

    mode: Mode = field(default=Mode.EVIBACK, metadata={"help": "grpo, dapo, eviback, or f1-fallback (all-zero "
                       "groups get the actor's own token F1 as reward, no teacher)"})
    lam: float = field(default=0.1, metadata={"help": "lambda: scale of fallback advantages (teacher or F1), after "
                       "normalisation"})
    eps: float = field(default=1e-6, metadata={"help": "epsilon added to the group std"})
    hit_threshold: float = field(default=1.0, metadata={"help": "EM at which a rollout is a verified hit"})

    def __post_init__(self) -> None:
        # a number where a number belongs, and `mode` as a Mode (a name of one), before the checks below
        check_fields(self)
        if not math.isfinite(self.lam) or self.lam < 0:
            raise ValueError(f"lam must be a finite number >= 0, got {self.lam}")
        if not math.isfinite(self.eps) or self.eps <= 0:
            raise ValueError(f"eps must be > 0 and finite (the training setting adv_eps), got {self.eps} (it keeps "
                             "the z-score finite for constant groups)")
        if not 0 < self.hit_threshold <= 1:
            raise ValueError(f"hit_threshold must be in (0, 1] (EM is 0 or 1: a hit at 1.0), got {self.hit_threshold}")


@dataclass(frozen=True)
class GroupAdvantages:
    """The outcome for one group. `rewards` are the rewards the advantages were computed from (EM, or for a
    fallback group the teacher's hybrid rewards or the actor's F1); `keep` is False when the group is dropped
    from the loss."""

    kind: GroupKind
    em: tuple[float, ...]
    rewards: tuple[float, ...]
    advantages: tuple[float, ...]
    keep: bool = True

    @property
    def informative(self) -> bool:
        """A fallback group whose rewards differ, so its advantages are not all zero: the teacher (or the F1
        rule) gave it a learning signal. (A fallback group whose rollouts all got the same reward has none.)"""
        return self.kind is GroupKind.FALLBACK and any(a != 0.0 for a in self.advantages)


def zscore(values: Sequence[float], eps: float) -> tuple[float, ...]:
    """`(v - mean) / (std + eps)` with the sample std (0 for a single value)."""
    n = len(values)
    if n == 0:
        return ()
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return tuple((v - mean) / (std + eps) for v in values)


def has_verified_hit(em: Sequence[float], config: BackoffConfig) -> bool:
    return any(e >= config.hit_threshold for e in em)


def needs_teacher(em: Sequence[float], config: BackoffConfig) -> bool:
    """True when the teacher must judge this group: EviBack mode and no verified hit."""
    return config.mode is Mode.EVIBACK and not has_verified_hit(em, config)


def group_advantages(
    em: Sequence[float], verdicts: Sequence[Verdict] | None, config: BackoffConfig,
    f1: Sequence[float] | None = None,
) -> GroupAdvantages:
    """Advantages of one group from its actor EM and, for a fallback group, the teacher's verdicts (eviback)
    or the actor's own token F1 against the gold (f1-fallback).

    `verdicts` is required (one per rollout) exactly when :func:`needs_teacher` is True, and ignored
    otherwise (the teacher is never consulted for a group with a verified hit). `f1` (one per rollout, 0 for
    a rollout without an answer) is required for an all-zero group in f1-fallback mode, and ignored otherwise."""
    em = tuple(float(e) for e in em)
    zeros = (0.0,) * len(em)
    if config.mode is Mode.DAPO and len(set(em)) <= 1:
        return GroupAdvantages(GroupKind.DROPPED, em, em, zeros, keep=False)
    if has_verified_hit(em, config):
        return GroupAdvantages(GroupKind.VERIFIED, em, em, zscore(em, config.eps))
    if config.mode is Mode.F1_FALLBACK:
        if f1 is None or len(f1) != len(em):
            got = "none" if f1 is None else len(f1)
            raise ValueError(f"an all-zero group of {len(em)} rollouts needs {len(em)} F1 values in f1-fallback "
                             f"mode, got {got}")
        rewards = tuple(float(x) for x in f1)
        advantages = tuple(config.lam * a for a in zscore(rewards, config.eps))
        return GroupAdvantages(GroupKind.FALLBACK, em, rewards, advantages)
    if config.mode is not Mode.EVIBACK:
        return GroupAdvantages(GroupKind.ALL_ZERO, em, em, zeros)
    if verdicts is None or len(verdicts) != len(em):
        got = "none" if verdicts is None else len(verdicts)
        raise ValueError(f"an all-zero group of {len(em)} rollouts needs {len(em)} verdicts, got {got}")
    if any(v.teacher_error or v.reward is None for v in verdicts):
        return GroupAdvantages(GroupKind.TEACHER_ERROR, em, em, zeros)
    rewards = tuple(float(v.reward) for v in verdicts)
    advantages = tuple(config.lam * a for a in zscore(rewards, config.eps))
    return GroupAdvantages(GroupKind.FALLBACK, em, rewards, advantages)


@dataclass(frozen=True)
class BatchSummary:
    """Counts over a batch of groups, for the training metrics."""

    groups: int
    verified: int
    all_zero: int  # groups without a verified hit, whatever happened next
    fallback: int  # all-zero groups given fallback rewards: judged without error, or F1 (may all be equal)
    teacher_error: int
    dropped: int
    informative_fallback: int = 0  # fallback groups whose advantages are not all zero

    @property
    def all_zero_share(self) -> float:
        return self.all_zero / self.groups if self.groups else 0.0

    @property
    def fallback_share(self) -> float:
        """Share of the groups that fell back to the teacher (or the F1 rule). It says the teacher was
        *asked*, not that it gave a signal: a fallback group whose rollouts all got the same reward has
        advantage 0."""
        return self.fallback / self.groups if self.groups else 0.0

    @property
    def informative_fallback_share(self) -> float | None:
        """Share of the fallback groups whose advantages are not all zero (None without fallback)."""
        return self.informative_fallback / self.fallback if self.fallback else None


def summarize(outcomes: Sequence[GroupAdvantages], config: BackoffConfig) -> BatchSummary:
    kinds = [o.kind for o in outcomes]
    return BatchSummary(
        groups=len(outcomes),
        verified=kinds.count(GroupKind.VERIFIED),
        all_zero=sum(not has_verified_hit(o.em, config) for o in outcomes),
        fallback=kinds.count(GroupKind.FALLBACK),
        teacher_error=kinds.count(GroupKind.TEACHER_ERROR),
        dropped=kinds.count(GroupKind.DROPPED),
        informative_fallback=sum(o.informative for o in outcomes),
    )
