"""The OpenAI-compatible client against a real local HTTP server that hangs, fails or talks nonsense."""

import threading

import pytest

from eviback.teacher.judge import JudgeConfig, RetryConfig, Teacher
from eviback.teacher.openai_http import HttpBackendConfig, OpenAIChatClient, StructuredOutput
from eviback.teacher.policy import load_policy
from eviback.teacher.probes import build_probes
from teacher_fakes import Fault, FaultyChatServer

TWO = load_policy("two-stage")
RETRY = RetryConfig(max_attempts=2, backoff_s=0.05)


@pytest.fixture(scope="module")
def rollouts():
    return [p.trajectory for p in build_probes(6, seed=2)]


def judge(server, rollouts, *, timeout_s=5.0, mode="response_format", concurrency=3, retry=RETRY):
    client = OpenAIChatClient(HttpBackendConfig(base_url=server.base_url, model="faulty", timeout_s=timeout_s,
                                                structured_output=mode))
    assert client.list_models() == ["faulty"]
    with Teacher(TWO, client, JudgeConfig(concurrency=concurrency, retry=retry)) as teacher:
        verdicts = teacher.judge(rollouts)
        return verdicts, teacher.stats().total, client


def test_a_healthy_server_gives_verdicts(rollouts):
    with FaultyChatServer(Fault.OK) as server:
        verdicts, stats, client = judge(server, rollouts)
    assert not any(v.teacher_error for v in verdicts)
    assert all(v.status is not None and v.stage_b_ran for v in verdicts)
    assert stats.calls == server.calls == 2 * len(rollouts)
    assert stats.prompt_tokens == 10 * stats.calls  # the server's usage is accounted


@pytest.mark.parametrize("fault, message", [
    (Fault.ERROR_500, "HTTP 500"),
    (Fault.GARBAGE, "malformed response body"),
    (Fault.MALFORMED, "schema violation"),
])
def test_a_failing_server_is_retried_then_teacher_error(rollouts, fault, message):
    with FaultyChatServer(fault) as server:
        verdicts, stats, _ = judge(server, rollouts)
    assert len(verdicts) == len(rollouts)
    assert all(v.teacher_error and message in v.error and v.reward is None for v in verdicts)
    assert stats.calls == server.calls == RETRY.max_attempts * len(rollouts)  # Stage A only: B never ran
    assert stats.retries == len(rollouts) * (RETRY.max_attempts - 1)


def test_a_hanging_server_times_out(rollouts):
    """The client's timeout cuts a hang: the server holds every request until it closes, so the judge can
    only return because each attempt timed out, which every verdict's error and the attempt count show. (A
    deadline far above 2 attempts x 0.5 s stops the test, rather than the suite, if the timeout is broken.)"""
    done: list = []
    with FaultyChatServer(Fault.HANG, hang_s=None) as server:
        worker = threading.Thread(target=lambda: done.append(judge(server, rollouts[:3], timeout_s=0.5)),
                                  daemon=True)
        worker.start()
        worker.join(timeout=300)
        assert done, "the judge did not return although every attempt has a 0.5 s timeout"
        assert server.hangs_ended == 0  # the server never let go: the client gave up on its own
    verdicts, stats, _ = done[0]
    assert all(v.teacher_error and "timed out" in v.error for v in verdicts)
    assert stats.calls == server.calls == RETRY.max_attempts * 3


def test_a_flaky_server_recovers_through_retries(rollouts):
    with FaultyChatServer(Fault.FLAKY, fail_first=2) as server:
        verdicts, stats, _ = judge(server, rollouts, concurrency=1, retry=RetryConfig(3, backoff_s=0.05))
    assert not any(v.teacher_error for v in verdicts)
    assert stats.retries == 2 and verdicts[0].retries == 2


def test_a_server_without_structured_output_is_used_without_it(rollouts):
    with FaultyChatServer(Fault.NO_SCHEMA) as server:
        verdicts, _, client = judge(server, rollouts, concurrency=1)
    assert not any(v.teacher_error for v in verdicts)
    assert client.structured_output is StructuredOutput.NONE  # dropped after the first 400


@pytest.mark.parametrize("mode", ["structured_outputs", "json_object", "none"])
def test_each_structured_output_mode(rollouts, mode):
    with FaultyChatServer(Fault.OK) as server:
        verdicts, _, _ = judge(server, rollouts[:2], mode=mode)
    assert not any(v.teacher_error for v in verdicts)


def test_an_unreachable_server_is_an_error_naming_the_fix(rollouts):
    client = OpenAIChatClient(HttpBackendConfig(base_url="http://127.0.0.1:9/v1", model="m", timeout_s=1))
    with Teacher(TWO, client, JudgeConfig(concurrency=1, retry=RetryConfig(max_attempts=1))) as teacher:
        verdict = teacher.judge_one(rollouts[0])
    assert verdict.teacher_error and "ConnectError" in verdict.error
    with pytest.raises(Exception, match="is the server running"):
        OpenAIChatClient(HttpBackendConfig(base_url="http://127.0.0.1:9/v1", timeout_s=1)).list_models()
