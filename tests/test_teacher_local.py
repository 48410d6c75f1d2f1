"""The local in-process backend on the bundled SmolLM2: replies always fit the schema, both policies run."""

import dataclasses

import pytest

from eviback.teacher.judge import JudgeConfig, Teacher
from eviback.teacher.policy import Decoding, load_policy
from eviback.teacher.probes import build_probes
from eviback.teacher.workflow import parse_reply, stage_request
from eviback.types import Status

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client():
    from eviback.teacher.local import LocalClient

    return LocalClient()


@pytest.fixture(scope="module")
def probes():
    return build_probes(4, seed=11)


def test_replies_always_parse_and_are_deterministic(client, probes):
    two = load_policy("two-stage")
    for stage in two.stages:
        request = stage_request(stage, probes[0].trajectory)
        reply = client.complete(request)
        output = parse_reply(reply.text, request.schema)  # raises if malformed
        assert output.status in stage.statuses
        assert reply.prompt_tokens > 100 and reply.completion_tokens > 0
        assert client.complete(request).text == reply.text  # greedy: the same reply again


def test_sampling_uses_the_label_distribution(client, probes):
    stage = load_policy("two-stage").stages[0]
    sampled = dataclasses.replace(stage, decoding=Decoding(temperature=5.0, max_tokens=8, seed=1))
    statuses = set()
    for k in range(8):
        request = stage_request(sampled, probes[1].trajectory, sample_index=k)
        statuses.add(parse_reply(client.complete(request).text, request.schema).status)
    assert statuses <= set(Status) and len(statuses) >= 2  # a flat distribution at high temperature


@pytest.mark.parametrize("name", ["two-stage", "single-prompt-dual-task"])
def test_both_policies_judge_real_rollouts(client, probes, name):
    policy = load_policy(name)
    with Teacher(policy, client, JudgeConfig(concurrency=2)) as teacher:
        verdicts = teacher.judge([p.trajectory for p in probes])
        stats = teacher.stats().total
    assert not any(v.teacher_error for v in verdicts)
    assert stats.schema_violations == 0 and stats.retries == 0
    for v in verdicts:
        assert v.status in set(Status) and v.reward is not None and 0.0 <= v.reward <= 1.0
        assert v.stage_b_ran == (len(policy.stages) > 1 and v.stage_a_status is not Status.INSUFFICIENT)
