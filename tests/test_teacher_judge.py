"""Batch judging: cache, retries and error paths, accounting, ordering, concurrency (scripted backends)."""

import threading
import time

import pytest

from eviback.teacher.cache import MemoryCache, SqliteCache
from eviback.teacher.chat import PermanentError, TransientError
from eviback.teacher.judge import JudgeConfig, RetryConfig, Teacher, summarize
from eviback.teacher.policy import load_policy
from eviback.teacher.probes import build_probes
from eviback.types import Group, Status
from teacher_fakes import ScriptedClient, default_reply

TWO = load_policy("two-stage")
NO_WAIT = JudgeConfig(concurrency=4, retry=RetryConfig(max_attempts=3, backoff_s=0.0))


@pytest.fixture(scope="module")
def rollouts():
    return [p.trajectory for p in build_probes(12, seed=1)]


def teacher(client, cache=None, config=NO_WAIT, policy=TWO):
    return Teacher(policy, client, config, cache=cache)


def test_cache_makes_a_rerun_free_and_keys_on_sample_and_policy(tmp_path, rollouts):
    path = tmp_path / "replies.sqlite"
    client = ScriptedClient()
    with teacher(client, SqliteCache(path)) as t:
        first = t.judge(rollouts)
    assert len(client.requests) == 2 * len(rollouts)  # S from Stage A: Stage B runs for every rollout
    client2 = ScriptedClient(lambda r: AssertionError("must not be called"))
    with teacher(client2, SqliteCache(path)) as t:  # a new process would see the same file
        second = t.judge(rollouts)
        stats = t.stats().total
    assert client2.requests == []
    assert [v.status for v in second] == [v.status for v in first]
    assert [v.reward for v in second] == [v.reward for v in first]
    assert stats.cache_hits == stats.requests == 2 * len(rollouts) and stats.calls == 0
    assert stats.paid_prompt_tokens == 0 and stats.prompt_tokens > 0  # cost of the policy, paid by nobody
    assert all(v.calls == 0 and v.cache_hits == 2 for v in second)
    # another teacher sample, or another policy version, is a different key
    client3 = ScriptedClient()
    with teacher(client3, SqliteCache(path)) as t:
        t.judge(rollouts[:2], sample_index=1)
    assert len(client3.requests) == 4
    client4 = ScriptedClient()
    with teacher(client4, SqliteCache(path), policy=load_policy("single-prompt-dual-task")) as t:
        t.judge(rollouts[:2])
    assert len(client4.requests) == 2


def test_only_well_formed_replies_are_cached(rollouts):
    cache = MemoryCache()
    client = ScriptedClient().enqueue("garbage", "garbage")
    with teacher(client, cache, JudgeConfig(concurrency=1, retry=RetryConfig(backoff_s=0))) as t:
        verdict = t.judge_one(rollouts[0])
        stats = t.stats().total
    assert not verdict.teacher_error and verdict.schema_violations == 2 and verdict.retries == 2
    assert len(cache) == 2  # A and B, each stored once, after parsing
    # the malformed replies were paid for, though the verdict's cost counts only the replies it used
    assert stats.paid_prompt_tokens > stats.prompt_tokens == verdict.prompt_tokens


def test_sqlite_cache_is_safe_across_threads(tmp_path, rollouts):
    cache = SqliteCache(tmp_path / "c.sqlite")
    client = ScriptedClient()
    with teacher(client, cache, JudgeConfig(concurrency=8, retry=RetryConfig(backoff_s=0))) as t:
        t.judge(rollouts * 3)  # the same requests from many threads at once
    assert len(SqliteCache(tmp_path / "c.sqlite")) == 2 * len(rollouts)


def test_transient_errors_are_retried_with_backoff(rollouts):
    client = ScriptedClient().enqueue(TransientError("HTTP 500"), TransientError("timed out"))
    waits = []
    t = teacher(client, config=JudgeConfig(concurrency=1, retry=RetryConfig(backoff_s=1.0, jitter=0.0)))
    t._sleep = waits.append
    verdict = t.judge_one(rollouts[0])
    assert not verdict.teacher_error and verdict.retries == 2 and verdict.calls == 4
    assert waits == [1.0, 2.0]  # exponential backoff


def test_persistent_failure_is_a_teacher_error_and_the_batch_finishes(rollouts):
    def script(request):
        return TransientError("HTTP 500 (injected)") if request.stage == "B" else default_reply(request)
    client = ScriptedClient(script)
    with teacher(client) as t:
        verdicts = t.judge(rollouts)
        stats = t.stats()
    assert len(verdicts) == len(rollouts)
    assert all(v.teacher_error and v.status is None and v.reward is None for v in verdicts)
    assert all("stage 'B'" in v.error and "after 3 call(s)" in v.error for v in verdicts)
    assert stats.by_stage["B"].errors == len(rollouts) and stats.by_stage["B"].calls == 3 * len(rollouts)
    assert stats.by_stage["A"].errors == 0
    summary = summarize(verdicts, TWO, stats, backend="scripted", wall_s=1.0)
    assert summary.errors == len(rollouts) and summary.status["error"] == len(rollouts)
    assert summary.reward_mean is None  # errors are not scored as 0


def test_permanent_errors_are_not_retried(rollouts):
    client = ScriptedClient(lambda r: PermanentError("HTTP 401 bad key"))
    with teacher(client) as t:
        verdict = t.judge_one(rollouts[0])
    assert verdict.teacher_error and verdict.calls == 1 and "401" in verdict.error


def test_unparseable_replies_end_as_schema_violations(rollouts):
    client = ScriptedClient(lambda r: "I am not sure about this one.")
    with teacher(client) as t:
        verdict = t.judge_one(rollouts[0])
    assert verdict.teacher_error and "schema violation" in verdict.error and verdict.schema_violations == 3


def test_verdicts_keep_the_input_order_and_groups_are_judged_as_one_batch(rollouts):
    def script(request):
        time.sleep(0.01 * (len(request.canonical_json()) % 5))  # finish out of order
        status = "I" if "Doc 1" in request.messages[-1].content and len(request.canonical_json()) % 3 == 0 else "S"
        return default_reply(request, status=status if request.stage == "A" else "S")
    with teacher(ScriptedClient(script)) as t:
        expected = [t.judge_one(r) for r in rollouts]
        batch = t.judge(rollouts)
        groups = [Group(rollouts[0].question, tuple(rollouts[:5])), Group(rollouts[5].question, tuple(rollouts[5:]))]
        per_group = t.judge_groups(groups)
    assert [v.status for v in batch] == [v.status for v in expected]
    assert [len(g) for g in per_group] == [5, len(rollouts) - 5]
    assert [v.status for g in per_group for v in g] == [v.status for v in expected]


def test_concurrency_is_bounded(rollouts):
    """Three requests are in flight at once, and never more. The first three wait for each other at a
    barrier, so the overlap does not depend on how fast the machine is; with a bound below three the barrier
    breaks after its (generous) timeout and the test fails saying so."""
    active, peak, started, lock = [0], [0], [0], threading.Lock()
    all_three = threading.Barrier(3, timeout=60)

    def script(request):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            started[0] += 1
            first = started[0] <= 3
        try:
            if first:
                all_three.wait()
                time.sleep(0.05)  # keep them in flight a moment: a fourth, were the bound broken, would show
        finally:
            with lock:
                active[0] -= 1
        return default_reply(request)
    with teacher(ScriptedClient(script), config=JudgeConfig(concurrency=3)) as t:
        verdicts = t.judge(rollouts)
    assert not all_three.broken, "three requests were never in flight at once"
    assert peak[0] == 3 and not any(v.teacher_error for v in verdicts)


def test_summary_counts(rollouts):
    def script(request):
        if request.stage == "A":
            return default_reply(request, status=["S", "A", "I"][len(request.canonical_json()) % 3])
        return default_reply(request, status="I" if len(request.canonical_json()) % 2 else "S")
    with teacher(ScriptedClient(script)) as t:
        verdicts = t.judge(rollouts)
        summary = summarize(verdicts, TWO, t.stats(), backend="scripted", wall_s=2.0)
    a = [v.stage_a_status for v in verdicts]
    assert summary.stage_a_status == {s.value: a.count(s) for s in Status}
    assert summary.stage_b_runs == sum(s is not Status.INSUFFICIENT for s in a)
    assert sum(summary.lowered.values()) == sum(
        v.status is Status.INSUFFICIENT and v.stage_a_status is not Status.INSUFFICIENT for v in verdicts)
    assert sum(summary.reward_histogram.values()) == len(rollouts)
    assert summary.total.requests == len(rollouts) + summary.stage_b_runs
    assert summary.rollouts_per_s == pytest.approx(len(rollouts) / 2.0)


def test_on_request_sees_cached_requests_too(rollouts):
    seen = []
    cache = MemoryCache()
    with Teacher(TWO, ScriptedClient(), NO_WAIT, cache=cache, on_request=seen.append) as t:
        t.judge(rollouts[:3])
        t.judge(rollouts[:3])
    assert len(seen) == 12 and {r.stage for r in seen} == {"A", "B"}


def test_teacher_config_from_yaml_builds_an_http_teacher(tmp_path, rollouts):
    import yaml

    from eviback.teacher.config import TeacherConfig, build_teacher
    from eviback.types import from_dict
    from teacher_fakes import Fault, FaultyChatServer

    with FaultyChatServer(Fault.OK) as server:
        text = f"""
policy: single-prompt-dual-task
backend: http
http: {{base_url: "{server.base_url}", structured_output: structured_outputs, timeout_s: 5}}
judge: {{concurrency: 2, retry: {{max_attempts: 2, backoff_s: 0}}}}
cache: {tmp_path / "replies.sqlite"}
"""
        config = from_dict(TeacherConfig, yaml.safe_load(text))
        with build_teacher(config) as teacher:
            verdicts = teacher.judge(rollouts[:2])
    assert teacher.policy.name == "single-prompt-dual-task" and teacher.client.backend_id == "openai-http:faulty"
    assert not any(v.teacher_error for v in verdicts) and len(SqliteCache(tmp_path / "replies.sqlite")) == 2


def test_a_reply_cut_at_max_tokens_names_the_fix_and_is_not_repaid_when_greedy(rollouts):
    from eviback.teacher.chat import ChatReply

    class Truncating(ScriptedClient):
        def complete(self, request):
            self.requests.append(request)
            return ChatReply('{"status": "S", "answer": "New York; NYC; New Yo', truncated=True)
    client = Truncating()
    with teacher(client) as t:
        verdict = t.judge_one(rollouts[0])
    assert verdict.teacher_error and "raise the stage's decoding.max_tokens" in verdict.error
    assert verdict.calls == 1  # temperature 0: the same cut reply would come back


class InProcessClient(ScriptedClient):
    """A scripted client that says it computes in this process (as the local model and the classifier do);
    it records the thread each call ran in and torch's thread count there."""

    in_process = True

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def complete(self, request):
        import torch

        self.calls.append((threading.current_thread().name, torch.get_num_threads()))
        return super().complete(request)


def test_an_in_process_teacher_judges_in_the_calling_thread(rollouts):
    """Threads add nothing to a model in this process but OpenMP teams that slow the trainer's own compute."""
    client = InProcessClient()
    with teacher(client, config=JudgeConfig(concurrency=8)) as t:
        assert t.in_process
        verdicts = t.judge(rollouts)
    assert {name for name, _ in client.calls} == {threading.current_thread().name}
    with teacher(ScriptedClient(), config=JudgeConfig(concurrency=8)) as t:  # the same verdicts from a pool
        assert not t.in_process
        assert [v.status for v in t.judge(rollouts)] == [v.status for v in verdicts]
    assert not any(thread.name.startswith("teacher") for thread in threading.enumerate())


def test_a_mixed_teachers_in_process_stage_runs_single_threaded_in_the_pool(rollouts):
    import torch

    remote, local = ScriptedClient(), InProcessClient()
    before = torch.get_num_threads()
    with teacher(remote, config=JudgeConfig(concurrency=4)) as t:
        t.stage_clients["A"] = local  # as a trained classifier answers Stage A beside a remote Stage B
        assert not t.in_process
        t.judge(rollouts)
    assert len(local.calls) == len(rollouts) and {s.stage for s in remote.requests} == {"B"}
    assert all(name.startswith("teacher") and threads == 1 for name, threads in local.calls)
    assert torch.get_num_threads() == before
