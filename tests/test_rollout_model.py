"""The rollout engine with the real SmolLM2 on the session's vLLM engine and the real BM25 retriever
over the embedded corpus: token traces that decode to the recorded turns, sampled-token log-probs, seeds,
and a real model continuing after real retrieved passages."""

from __future__ import annotations

import pytest

from eviback.data import load_suite, read_questions
from eviback.generation.base import Completion, FinishReason, SamplingConfig
from eviback.protocol import INVALID_ACTION_MESSAGE
from eviback.rollout import RolloutConfig, RolloutEngine
from eviback.types import ActionKind, StopReason, Trajectory

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def retriever():
    from eviback.retrieval import suite_retriever

    r = suite_retriever()
    yield r
    r.close()


@pytest.fixture(scope="module")
def questions():
    return read_questions(load_suite().eval["nq"])[:3]


class SearchFirst:
    """The real backend, except that each trajectory's first turn is a scripted search (the untrained
    model never searches by itself): later turns are the real model reading real retrieved passages."""

    def __init__(self, backend, query: str = "") -> None:
        self.inner, self.query = backend, query
        self.name, self.tokenizer, self.max_context = backend.name, backend.tokenizer, backend.max_context
        self.first: set[tuple[int, ...]] = set()

    def generate(self, prompts, params: SamplingConfig, max_tokens=None):
        if not self.first:  # the first call holds the prompts only
            self.first = {tuple(p) for p in prompts}
            text = "<think>I need to look this up.</think>\n<search> {} </search>"
            outs = []
            for p in prompts:
                question = self.tokenizer.decode(p).split("Question: ")[-1].split("?")[0]
                ids = self.tokenizer(text.format(self.query or question), add_special_tokens=False)["input_ids"]
                outs.append(Completion(tuple(ids), self.tokenizer.decode(ids), tuple([0.0] * len(ids)), FinishReason.STOP))
            return outs
        return self.inner.generate(prompts, params, max_tokens)

    def reseed(self, seed):
        self.inner.reseed(seed)

    def update_weights(self, weights):
        self.inner.update_weights(weights)

    def close(self):
        """The inner backend is shared."""


def check_trace(t: Trajectory, tokenizer) -> None:
    """Every model token has mask 1 and decodes to the turn texts; every observation token has mask 0
    and decodes to the observations; the sampled tokens carry log-probabilities."""
    tokens = t.tokens
    assert len(tokens.ids) == len(tokens.mask) == len(tokens.logprobs)
    runs: list[tuple[int, list[int], list[float]]] = []
    for token, mask, lp in zip(tokens.ids, tokens.mask, tokens.logprobs, strict=True):
        if runs and runs[-1][0] == mask:
            runs[-1][1].append(token)
            runs[-1][2].append(lp)
        else:
            runs.append((mask, [token], [lp]))
    model = [r for r in runs if r[0] == 1]
    observed = [r for r in runs if r[0] == 0]
    assert [tokenizer.decode(ids, skip_special_tokens=True) for _, ids, _ in model] == [turn.text for turn in t.turns]
    assert [tokenizer.decode(ids) for _, ids, _ in observed] == [turn.observation for turn in t.turns if turn.observation]
    assert all(lp == 0.0 for _, _, lps in observed for lp in lps)
    return model


def test_real_model_rollout_traces(vllm_backend, retriever, questions):
    engine = RolloutEngine(vllm_backend, retriever,
                           RolloutConfig(group_size=2, max_turns=2, max_turn_tokens=48, temperature=1.0))
    batch = engine.rollout(questions, seed=11)
    assert len(batch.groups) == 3 and all(len(g.trajectories) == 2 for g in batch.groups)
    for t in batch.trajectories:
        model_runs = check_trace(t, vllm_backend.tokenizer)
        assert any(lp < 0 for _, _, lps in model_runs for lp in lps)  # real sampled log-probs
        assert t.stop_reason in (StopReason.ANSWERED, StopReason.FORCED)
        assert len(t.turns) <= 3
        for turn in t.turns[:-1]:
            assert turn.observation == INVALID_ACTION_MESSAGE or turn.executed
    again = engine.rollout(questions, seed=11)
    assert [t.tokens.ids for t in again.trajectories] == [t.tokens.ids for t in batch.trajectories]
    # every sampled token is in a trace, except the EOS that ended an invalid turn (left out of the context)
    kept = sum(sum(t.tokens.mask) for t in batch.trajectories)
    invalid = sum(turn.observation == INVALID_ACTION_MESSAGE for t in batch.trajectories for turn in t.turns)
    assert kept <= batch.generated_tokens <= kept + invalid


def test_real_model_continues_after_real_passages(vllm_backend, retriever, questions):
    backend = SearchFirst(vllm_backend)
    engine = RolloutEngine(backend, retriever,
                           RolloutConfig(group_size=1, max_turns=1, max_turn_tokens=48, temperature=0))
    batch = engine.rollout(questions)
    assert batch.turns[0].searches == 3 and batch.turns[1].active == 3
    for t in batch.trajectories:
        first = t.turns[0]
        assert first.action.kind is ActionKind.SEARCH and first.executed and len(first.passages) == 3
        assert first.observation.startswith("\n\n<information>Doc 1(Title: ")
        assert len(t.turns) == 2  # max_turns=1: the second turn is final, its search (if any) not executed
        assert not t.turns[1].executed
        check_trace(t, vllm_backend.tokenizer)
    # turn 2 of the batched engine = the backend continuing the recorded context on its own
    t = batch.trajectories[0]
    start, end = model_spans(t)[1]
    context = list(t.tokens.prompt_ids) + list(t.tokens.ids[:start])
    [direct] = vllm_backend.generate([context], engine.config.sampling())
    assert direct.token_ids == t.tokens.ids[start:end]


def model_spans(t: Trajectory) -> list[tuple[int, int]]:
    """[start, end) of each run of model tokens (mask 1) in the response."""
    spans, start = [], None
    for i, mask in enumerate([*t.tokens.mask, 0]):
        if mask == 1 and start is None:
            start = i
        elif mask == 0 and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_batched_engine_matches_one_trajectory_at_a_time(retriever, questions):
    """Greedy, float32: all trajectories of a batch together give the same tokens as each one alone,
    through a search, real passages and a second turn (bf16 kernels are not batch-invariant: a
    near-tied argmax can flip with the batch shape, so the comparison is made in float32)."""
    from eviback.generation.hf import HFBackend

    backend = SearchFirst(HFBackend.load("smollm2-135m", dtype="float32", threads=1))
    config = RolloutConfig(group_size=2, max_turns=1, max_turn_tokens=24, temperature=0)
    batched = RolloutEngine(backend, retriever, config).rollout(questions).trajectories
    alone = []
    for q in questions:
        for _ in range(config.group_size):
            backend.first = set()  # each one-trajectory rollout starts with its scripted search again
            alone.extend(RolloutEngine(backend, retriever, config).rollout([q], group_size=1).trajectories)
    assert all(len(t.turns) == 2 and t.turns[0].executed for t in batched)
    assert [t.tokens.ids for t in alone] == [t.tokens.ids for t in batched]
    assert [t.response for t in alone] == [t.response for t in batched]
