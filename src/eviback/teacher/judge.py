"""Judging rollouts in batches: bounded concurrency, retries with backoff, the cache, and cost accounting.

The entry point for training and E2E-APE is :class:`Teacher`::

    teacher = Teacher(load_policy("two-stage"), OpenAIChatClient(HttpBackendConfig(base_url=...)),
                      JudgeConfig(concurrency=8), cache=SqliteCache(path))
    verdicts = teacher.judge(trajectories)      # one Verdict per trajectory, same order
    teacher.stats()                              # calls, tokens, latency, cache hits, errors per stage

Contract of :meth:`Teacher.judge`: `len(verdicts) == len(trajectories)`, in order; it never raises for one
failed rollout: a call that still fails after its retries yields a verdict with `error` set (a
`teacher_error`), never a silent 0. The policy need not be frozen (E2E-APE evaluates candidates as plain
:class:`TeacherPolicy` objects); its content-hash version keys the cache either way.
"""

from __future__ import annotations

import collections
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from eviback.data import DataError, read_jsonl
from eviback.policy import torch_threads
from eviback.settings import check_fields
from eviback.teacher.cache import ReplyCache
from eviback.teacher.chat import ChatRequest, SchemaViolation, TeacherCallError, TeacherClient
from eviback.teacher.evidence_judge import open_classifier
from eviback.teacher.labels import Agreement, agreement, trajectory_label
from eviback.teacher.policy import TeacherPolicy
from eviback.teacher.rules import RuleClient
from eviback.teacher.workflow import StageOutcome, parse_reply, run_workflow
from eviback.types import Group, Status, Trajectory, Verdict, from_dict

log = logging.getLogger(__name__)


def _in_process(client: TeacherClient) -> bool:
    """The client computes in this process with torch (it says so with `in_process = True`)."""
    return bool(getattr(client, "in_process", False))


@dataclass(frozen=True)
class RetryConfig:
    """How a failed stage call is retried (transient errors and malformed replies; not permanent errors)."""

    max_attempts: int = 3  # attempts per stage call, the first included
    backoff_s: float = 0.5  # wait before the 2nd attempt; doubled (`backoff_factor`) for each next one
    backoff_factor: float = 2.0
    max_backoff_s: float = 8.0  # cap of one wait
    jitter: float = 0.25  # +- fraction of random jitter, so concurrent retries do not stampede a server

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts={self.max_attempts} (the --max-attempts option) must be >= 1 (1 means no "
                             "retry)")
        for name, option in (("backoff_s", " (the --backoff option)"), ("max_backoff_s", "")):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name}{option} must be a number of seconds >= 0, got {getattr(self, name)}")
        if not 1 <= self.backoff_factor < math.inf:
            raise ValueError(f"backoff_factor must be >= 1 (1: the same wait each time), got {self.backoff_factor}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1] (a fraction of the wait), got {self.jitter}")

    def wait_s(self, attempt: int, rng: random.Random) -> float:
        """The wait after failed attempt number `attempt` (1-based)."""
        base = min(self.max_backoff_s, self.backoff_s * self.backoff_factor ** (attempt - 1))
        return max(0.0, base * (1 + self.jitter * (2 * rng.random() - 1)))


@dataclass(frozen=True)
class JudgeConfig:
    """How rollouts are judged in a batch."""

    concurrency: int = 8  # rollouts judged at once (each runs its stages in order); bound on open calls
    retry: RetryConfig = field(default_factory=RetryConfig)

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the check below compares a number
        if not isinstance(self.retry, RetryConfig):
            raise ValueError(f"JudgeConfig.retry must be a RetryConfig, got {self.retry!r}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency} (the --concurrency option; teacher_concurrency in a "
                             "training run) must be >= 1")


@dataclass(frozen=True)
class StageStats:
    """Accounting of one stage (or of all stages, in `TeacherStats.total`).

    `requests` = stage requests the workflow made; `cache_hits` of them were served from the cache; `calls`
    = backend calls actually made (retries included); tokens are those of the replies used, cached or not;
    `paid_*_tokens` those of every reply fetched from the backend (malformed ones included, cached ones
    not); `latency_s` sums the
    backend calls; `errors` = requests that ended as teacher_error."""

    requests: int = 0
    cache_hits: int = 0
    calls: int = 0
    retries: int = 0
    schema_violations: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    paid_prompt_tokens: int = 0
    paid_completion_tokens: int = 0
    latency_s: float = 0.0

    def __add__(self, other: StageStats) -> StageStats:
        return StageStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


@dataclass(frozen=True)
class TeacherStats:
    by_stage: Mapping[str, StageStats]

    @property
    def total(self) -> StageStats:
        total = StageStats()
        for stats in self.by_stage.values():
            total = total + stats
        return total


class Teacher:
    """Judges rollouts with one policy on one backend. Thread-safe; reusable across training steps."""

    def __init__(
        self,
        policy: TeacherPolicy,
        client: TeacherClient,
        config: JudgeConfig = JudgeConfig(),
        *,
        cache: ReplyCache | None = None,
        seed: int = 0,
        on_request: Callable[[ChatRequest], None] | None = None,
        owns_resources: bool = False,
        device: str = "auto",
    ) -> None:
        """`on_request` sees every stage request before the cache is consulted (e.g. E2E-APE's canary audit:
        a cached reply is never sent again, but its request is still inspected). With `owns_resources`,
        :meth:`close` also closes the client and the cache (set by `build_teacher`); by default they are the
        caller's, so one client and one cache can serve many teachers (e.g. E2E-APE's candidates). `device`:
        where a stage's own model (a trained evidence judge) computes (`eviback.device`)."""
        self.owns_resources = owns_resources
        self.policy = policy
        self.client = client
        self.config = config
        self.cache = cache
        self.on_request = on_request
        self._stats: dict[str, StageStats] = collections.defaultdict(StageStats)
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._sleep = time.sleep  # replaced in tests to keep backoff instant
        self._pool: ThreadPoolExecutor | None = None  # created on the first concurrent judge call
        self._in_pool = threading.local()  # `worker` is set in the pool's threads
        # stages answered by a backend of their own instead of `client`: a classifier artifact (a trained
        # evidence judge) or a rule (eviback.teacher.rules)
        self.stage_clients: dict[str, TeacherClient] = {}
        for stage in policy.stages:
            if stage.is_rule:
                self.stage_clients[stage.name] = RuleClient(stage.backend)
            elif stage.is_classifier:
                self.stage_clients[stage.name] = open_classifier(stage.backend, device)

    # ----------------------------------------------------------------------------------------------

    def judge(self, trajectories: Sequence[Trajectory], *, sample_index: int = 0) -> list[Verdict]:
        """Verdicts for `trajectories`, in order; `sample_index` selects the teacher sample (for repeated
        sampling: sample k of the same request is cached separately and, where seeded, seeded k)."""
        trajectories = list(trajectories)
        if not trajectories:
            return []
        if min(self.config.concurrency, len(trajectories)) == 1 or self.in_process:
            return [self.judge_one(t, sample_index=sample_index) for t in trajectories]
        return list(self._executor().map(lambda t: self.judge_one(t, sample_index=sample_index), trajectories))

    @property
    def in_process(self) -> bool:
        """Every stage is answered in this process (a local model, a classifier): rollouts are then judged
        one after another in the calling thread, whatever `concurrency` says. Such a client computes one
        request at a time anyway, and computing from the pool's threads would start an OpenMP team in each,
        after which every team in the process, the trainer's included, stops spin-waiting: a training step
        after judging from the pool kept 1.07-1.59 of 2 cores busy, against 1.70-1.78 after judging in the
        caller's thread (results/teacher-threads.md)."""
        return all(_in_process(self.stage_clients.get(stage.name, self.client)) for stage in self.policy.stages)

    def _executor(self) -> ThreadPoolExecutor:
        """One pool for the teacher's life: its threads (and the per-thread cache connections they open)
        are reused by every call, rather than a new pool, new threads and new connections per call."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.config.concurrency, thread_name_prefix="teacher",
                                                initializer=self._mark_worker)
            return self._pool

    def _mark_worker(self) -> None:
        self._in_pool.worker = True

    def judge_groups(self, groups: Sequence[Group], *, sample_index: int = 0) -> list[tuple[Verdict, ...]]:
        """Verdicts per group: all rollouts of all groups are judged concurrently, as one batch."""
        flat = [t for g in groups for t in g.trajectories]
        verdicts = iter(self.judge(flat, sample_index=sample_index))
        return [tuple(next(verdicts) for _ in g.trajectories) for g in groups]

    def judge_one(self, trajectory: Trajectory, *, sample_index: int = 0) -> Verdict:
        return run_workflow(self.policy, trajectory, self._call_stage, sample_index)

    def stats(self) -> TeacherStats:
        with self._lock:
            return TeacherStats(by_stage=dict(self._stats))

    def close(self) -> None:
        """Stop the teacher's threads; with `owns_resources`, also close the client and the cache."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if not self.owns_resources:
            return
        self.client.close()
        if self.cache is not None:
            self.cache.close()

    def __enter__(self) -> Teacher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------------

    def _call_stage(self, request: ChatRequest) -> StageOutcome:
        """One stage request: cache, then attempts with backoff; never raises a TeacherCallError."""
        if self.on_request is not None:
            self.on_request(request)
        outcome = self._attempts(request)
        stats = StageStats(
            requests=1, cache_hits=int(outcome.cache_hit), calls=outcome.calls, retries=outcome.retries,
            schema_violations=outcome.schema_violations, errors=int(outcome.error is not None),
            prompt_tokens=outcome.prompt_tokens, completion_tokens=outcome.completion_tokens,
            paid_prompt_tokens=outcome.paid_prompt_tokens, paid_completion_tokens=outcome.paid_completion_tokens,
            latency_s=outcome.latency_s,
        )
        with self._lock:
            self._stats[request.stage] = self._stats[request.stage] + stats
        return outcome

    def _attempts(self, request: ChatRequest) -> StageOutcome:
        calls = retries = violations = paid_prompt = paid_completion = 0
        latency = 0.0
        key = None
        client = self.stage_clients.get(request.stage, self.client)
        # a client may say its replies are not worth caching (a rule: cheaper to compute than to look up)
        cache = self.cache if getattr(client, "cacheable", True) else None
        try:
            key = request.cache_key(self.policy.version, client.backend_id)
            if cache is not None and (cached := cache.get(key)) is not None:
                try:
                    output = parse_reply(cached.text, request.schema)
                    return StageOutcome(output=output, cache_hit=True, prompt_tokens=cached.prompt_tokens,
                                        completion_tokens=cached.completion_tokens)
                except SchemaViolation:
                    pass  # a parser change made an old entry unusable: ask the backend again
        except TeacherCallError as e:  # e.g. the backend could not even name its model
            return StageOutcome(output=None, error=str(e))
        error = "no attempt made"
        for attempt in range(1, self.config.retry.max_attempts + 1):
            if attempt > 1:
                retries += 1
                self._sleep(self.config.retry.wait_s(attempt - 1, self._rng))
            calls += 1
            start = time.perf_counter()
            reply = None
            try:
                # an in-process stage of a mixed teacher (a classifier beside a remote LLM), called from the
                # pool: single-threaded torch, so that the pool's threads start no OpenMP teams (in_process)
                single = _in_process(client) and getattr(self._in_pool, "worker", False)
                with torch_threads(1 if single else None):
                    reply = client.complete(request)
                latency += time.perf_counter() - start
                paid_prompt += reply.prompt_tokens  # a malformed reply was paid for too
                paid_completion += reply.completion_tokens
                output = parse_reply(reply.text, request.schema)
            except SchemaViolation as e:
                violations += 1
                error = f"schema violation: {e}"
                if reply is not None and reply.truncated:
                    error = (f"schema violation: the reply was cut at max_tokens={request.decoding.max_tokens} "
                             f"before its JSON closed; raise the stage's decoding.max_tokens ({e})")
                    if request.decoding.temperature == 0:
                        break  # greedy decoding would cut the same reply again: do not pay for it twice
                continue
            except TeacherCallError as e:
                latency += time.perf_counter() - start
                error = str(e)
                if not e.retryable:
                    break
                continue
            if cache is not None and key is not None:
                cache.put(key, reply, stage=request.stage, policy_version=self.policy.version)
            return StageOutcome(output=output, calls=calls, prompt_tokens=reply.prompt_tokens,
                                completion_tokens=reply.completion_tokens, latency_s=latency, retries=retries,
                                schema_violations=violations, paid_prompt_tokens=paid_prompt,
                                paid_completion_tokens=paid_completion)
        log.debug("stage %s failed after %d call(s): %s", request.stage, calls, error)
        return StageOutcome(output=None, error=f"{error} (after {calls} call(s))", calls=calls,
                            latency_s=latency, retries=retries, schema_violations=violations,
                            paid_prompt_tokens=paid_prompt, paid_completion_tokens=paid_completion)


# --------------------------------------------------------------------------------------------------
# Dumps in, verdicts and a summary out (`eviback judge`)


@dataclass(frozen=True)
class JudgedRollout:
    """One line of a verdicts JSONL: which rollout, which teacher sample, and the verdict."""

    question_id: str
    sample_index: int  # the rollout's position in its group
    teacher_sample: int
    verdict: Verdict
    label: Status | None = None  # the evidence label (`eviback judge --labels`): the yardstick, never an input


def read_trajectories(path: str | Path, limit: int | None = None) -> list[Trajectory]:
    """Trajectories from a JSONL dump: each line a trajectory (`to_dict(Trajectory)`) or an object with a
    `trajectory` key (evaluation and training dumps). Malformed lines raise DataError naming the line."""
    out: list[Trajectory] = []
    for number, obj in enumerate(read_jsonl(path), start=1):
        if limit is not None and len(out) >= limit:
            break
        if isinstance(obj, dict) and isinstance(obj.get("trajectory"), dict):
            obj = obj["trajectory"]
        if not isinstance(obj, dict) or "question" not in obj or "turns" not in obj:
            raise DataError(path, number, "expected a trajectory object (with 'question' and 'turns') or an "
                                          "object with a 'trajectory' key")
        try:
            out.append(from_dict(Trajectory, obj))
        except (ValueError, TypeError, KeyError) as e:
            raise DataError(path, number, f"malformed trajectory: {e}") from None
    return out


_REWARD_BINS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class JudgeSummary:
    """What `eviback judge` reports for a batch of verdicts.

    `lowered` counts demotions after Stage A (`S->I`, `A->I`), by a later stage or by the grounding rule;
    `ungrounded` those by the grounding rule; `reward_histogram` buckets the rewards of the
    verdicts without error: `0` is exactly 0, `(0,0.25]` ... `(0.75,1]`."""

    policy: str
    policy_version: str
    backend: str
    rollouts: int
    errors: int
    status: Mapping[str, int]  # final status counts, plus "error"
    stage_a_status: Mapping[str, int]
    stage_b_runs: int
    stage_b_run_rate: float
    lowered: Mapping[str, int]
    ungrounded: int  # verdicts lowered to I because the refined answer was not in the evidence as seen
    reward_mean: float | None
    reward_histogram: Mapping[str, int]
    stages: Mapping[str, StageStats]
    total: StageStats
    wall_s: float
    rollouts_per_s: float
    error_examples: tuple[str, ...] = ()
    stage_a_agreement: Agreement | None = None  # with the evidence labels (`eviback judge --labels`)
    # the trained evidence judge that decided Stage A, if one did: its name, hash and held-out figures
    # (eviback.teacher.evidence_judge.Competence.to_dict)
    evidence_judge: Mapping[str, Any] | None = None


def summarize(
    verdicts: Sequence[Verdict], policy: TeacherPolicy, stats: TeacherStats, *, backend: str, wall_s: float
) -> JudgeSummary:
    ok = [v for v in verdicts if not v.teacher_error]
    status = collections.Counter(v.status.value for v in ok if v.status is not None)
    status["error"] = len(verdicts) - len(ok)
    stage_a = collections.Counter(v.stage_a_status.value for v in verdicts if v.stage_a_status is not None)
    lowered = collections.Counter(
        f"{v.stage_a_status.value}->I" for v in ok
        if v.stage_a_status not in (None, Status.INSUFFICIENT) and v.status is Status.INSUFFICIENT
    )
    rewards = [v.reward for v in ok if v.reward is not None]
    histogram = {"0": sum(r == 0 for r in rewards)}
    for low, high in zip(_REWARD_BINS, _REWARD_BINS[1:], strict=False):
        histogram[f"({low:g},{high:g}]"] = sum(low < r <= high for r in rewards)
    runs = sum(v.stage_b_ran for v in verdicts)
    examples = tuple(dict.fromkeys(v.error for v in verdicts if v.error))[:5]
    return JudgeSummary(
        policy=policy.name, policy_version=policy.version, backend=backend, rollouts=len(verdicts),
        errors=len(verdicts) - len(ok),
        status={k: status.get(k, 0) for k in ("S", "A", "I", "error")},
        stage_a_status={k: stage_a.get(k, 0) for k in ("S", "A", "I")},
        stage_b_runs=runs, stage_b_run_rate=runs / len(verdicts) if verdicts else 0.0,
        lowered={k: lowered.get(k, 0) for k in ("S->I", "A->I")},
        ungrounded=sum(v.ungrounded for v in ok),
        reward_mean=sum(rewards) / len(rewards) if rewards else None, reward_histogram=histogram,
        stages=dict(stats.by_stage), total=stats.total, wall_s=wall_s,
        rollouts_per_s=len(verdicts) / wall_s if wall_s > 0 else 0.0, error_examples=examples,
    )


def judged_rollouts(
    trajectories: Iterable[Trajectory], verdicts: Iterable[Verdict], teacher_sample: int = 0,
    *, labels: bool = False,
) -> list[JudgedRollout]:
    """One record per rollout; with `labels`, the evidence label of each rollout beside its verdict."""
    return [JudgedRollout(t.question.id, t.sample_index, teacher_sample, v,
                          trajectory_label(t) if labels else None)
            for t, v in zip(trajectories, verdicts, strict=True)]


def stage_a_agreement(trajectories: Sequence[Trajectory], verdicts: Sequence[Verdict]) -> Agreement:
    """How Stage A's status agrees with the evidence labels, over the verdicts without error."""
    pairs = [(trajectory_label(t), v.stage_a_status) for t, v in zip(trajectories, verdicts, strict=True)
             if v.stage_a_status is not None]
    return agreement([p[0] for p in pairs], [p[1] for p in pairs])
