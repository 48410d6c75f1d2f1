"""The local backend turns only a request that cannot succeed into a teacher error; failures propagate."""

from types import SimpleNamespace

import pytest

from eviback.teacher.chat import PermanentError
from eviback.teacher.judge import JudgeConfig, Teacher
from eviback.teacher.local import LocalClient
from eviback.teacher.policy import load_policy
from eviback.teacher.probes import build_probes
from eviback.teacher.workflow import stage_request


class FailingModel:
    """A model whose forward pass fails as a real one does when memory runs out."""

    def __init__(self, context: int, error: Exception) -> None:
        self.config = SimpleNamespace(max_position_embeddings=context)
        self.error = error
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        raise self.error


@pytest.fixture(scope="module")
def tokenizer():
    from eviback.policy import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def trajectory():
    return build_probes(1, seed=5)[0].trajectory


def test_a_prompt_longer_than_the_context_is_a_teacher_error_checked_before_running(tokenizer, trajectory):
    model = FailingModel(context=64, error=AssertionError("the model must not run"))
    client = LocalClient(model=model, tokenizer=tokenizer)
    with pytest.raises(PermanentError, match="context of 64 tokens"):
        client.complete(stage_request(load_policy("two-stage").stages[0], trajectory))
    assert model.calls == 0
    # through the judge: a teacher error, counted, and the run goes on
    verdict = Teacher(load_policy("two-stage"), client).judge_one(trajectory)
    assert verdict.teacher_error and "context" in verdict.error


@pytest.mark.parametrize("error", [RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough "
                                                "memory: you tried to allocate 4294967296 bytes."),
                                   IndexError("index out of range in self"), ValueError("a bug")])
def test_out_of_memory_and_bugs_propagate(tokenizer, trajectory, error):
    client = LocalClient(model=FailingModel(context=8192, error=error), tokenizer=tokenizer)
    with pytest.raises(type(error)):
        client.complete(stage_request(load_policy("two-stage").stages[0], trajectory))
    with Teacher(load_policy("two-stage"), client, JudgeConfig(concurrency=2)) as teacher, \
            pytest.raises(type(error)):
        teacher.judge([trajectory, trajectory])
