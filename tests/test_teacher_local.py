"""The local in-process backend on the bundled SmolLM2: replies always fit the schema, both policies run."""

import pytest

from eviback.teacher.judge import JudgeConfig, Teacher
from eviback.teacher.policy import Decoding, Input, OutputField, StageSpec, load_policy
from eviback.teacher.probes import build_probes
from eviback.teacher.workflow import BlindView, build_blind_request, parse_reply, stage_request
from eviback.types import Status

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client():
    import torch

    from eviback.teacher.local import LocalBackendConfig, LocalClient

    # One intra-op thread: on a busy 2-core machine two OpenMP threads spin against other processes and a
    # forward pass gets an order of magnitude slower. The setting is process-wide, so it is restored after.
    threads = torch.get_num_threads()
    yield LocalClient(LocalBackendConfig(threads=1))
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def probes():
    return build_probes(3, seed=11)


def test_replies_always_parse_and_are_deterministic(client, probes):
    two = load_policy("two-stage")
    for stage in two.stages:
        request = stage_request(stage, probes[0].trajectory)
        reply = client.complete(request)
        output = parse_reply(reply.text, request.schema)  # raises if malformed
        assert output.status in stage.statuses
        assert reply.prompt_tokens > 100 and reply.completion_tokens > 0
    assert client.complete(request).text == reply.text  # greedy: the same reply again


def test_sampling_uses_the_label_distribution(client):
    # a short prompt keeps this cheap; at a high temperature the label distribution is nearly flat
    stage = StageSpec(name="A", sees=(Input.QUESTION,), system_prompt="",
                      user_template="Question: $question\nReply S, A or I.", outputs=(OutputField.STATUS,),
                      decoding=Decoding(temperature=20.0, max_tokens=8, seed=1))
    view = BlindView(question="Who wrote Hamlet?", evidence=(), answer=None)
    statuses = set()
    for k in range(6):
        request = build_blind_request(stage, view, sample_index=k)
        statuses.add(parse_reply(client.complete(request).text, request.schema).status)
    assert len(statuses) >= 2


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
