"""Honest sampling in every engine: a rollout is sampled from the distribution the trainer scores, and the
log-probability recorded with each token is that distribution's, `log_softmax(logits / temperature)` (after
top-p when asked), whatever the model's own generation defaults say.

transformers 5.17 fills every unset sampling field of a `generate` call from the model's generation_config
and then its global defaults (`top_k=50`), and vLLM's server fills a request's unset fields from the served
model's `generation_config.json` (Qwen3: `top_k=20, top_p=0.95`): either would sample from a few tokens while
the trainer's importance ratios describe all of them. The model here spreads its next-token distribution over
hundreds of tokens and ships those defaults; each engine must still sample more than 50 distinct tokens.
The HF engine is checked here on a tiny model; the policy server against a real `vllm serve` in
tests/test_policy_server_e2e.py, and the in-process vLLM engine on the session's engine below."""

from __future__ import annotations

import math

import pytest
import torch

from eviback.generation.base import SamplingConfig
from eviback.generation.hf import (
    HFBackend,
    TokenSampler,
    check_sampling_is_ours,
    generation_config,
    top_p_filter,
)
from eviback.generation.vllm_cpu import SamplerBroken, check_cpu_sampler


class Tokenizer:
    """Enough of a tokenizer for the HF backend: ids are their own text."""

    pad_token_id = 0
    eos_token_id = 1

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def spread_model(vocab: int = 400, seed: int = 0):
    """A tiny Qwen3 whose next-token distribution spreads over hundreds of tokens, shipping Qwen3's sampling
    defaults (and a few more) in its generation_config."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # logits of a few units: spread, and far from uniform
    g = model.generation_config
    g.do_sample, g.top_k, g.top_p, g.temperature, g.min_p = True, 20, 0.95, 0.6, 0.1
    g.repetition_penalty, g.no_repeat_ngram_size, g.typical_p = 1.3, 2, 0.5
    return model


PROMPT = [5, 17, 42, 9]


def next_token_logits(model, prompt=PROMPT) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0, -1].float()


def test_the_hf_engine_samples_the_whole_distribution_whatever_the_models_defaults():
    model = spread_model()
    backend = HFBackend(model, Tokenizer(), batch_size=2000)
    backend.reseed(0)
    params = SamplingConfig(max_tokens=1, temperature=1.0, stop=())
    out = backend.generate([PROMPT] * 2000, params)
    tokens = [c.token_ids[0] for c in out]
    assert len(set(tokens)) > 50, len(set(tokens))  # top_k=20 (the model's) or 50 (transformers') would cap it
    expected = torch.log_softmax(next_token_logits(model), dim=-1)
    for completion in out[:200]:
        (token,), (logprob,) = completion.token_ids, completion.logprobs
        assert logprob == pytest.approx(float(expected[token]), abs=1e-4)
    # the sampled frequencies follow the distribution (no truncation, no temperature of the model's)
    top = int(expected.argmax())
    assert tokens.count(top) / len(tokens) == pytest.approx(math.exp(float(expected[top])), abs=0.03)


@pytest.mark.parametrize(("temperature", "top_p"), [(0.7, 1.0), (1.3, 0.8)])
def test_recorded_logprobs_are_those_of_the_distribution_sampled_from(temperature, top_p):
    model = spread_model(seed=1)
    backend = HFBackend(model, Tokenizer(), batch_size=300)
    backend.reseed(1)
    out = backend.generate([PROMPT] * 300, SamplingConfig(max_tokens=1, temperature=temperature, top_p=top_p, stop=()))
    logits = next_token_logits(model) / temperature
    expected = torch.log_softmax(top_p_filter(logits[None], top_p)[0] if top_p < 1 else logits, dim=-1)
    for completion in out:
        (token,), (logprob,) = completion.token_ids, completion.logprobs
        assert math.isfinite(float(expected[token]))  # never a token top-p excluded
        assert logprob == pytest.approx(float(expected[token]), abs=1e-4)


def test_greedy_records_the_models_own_distribution_at_its_argmax():
    model = spread_model(seed=2)
    backend = HFBackend(model, Tokenizer(), batch_size=4)
    out = backend.generate([PROMPT], SamplingConfig(max_tokens=1, temperature=0, stop=()))
    logp = torch.log_softmax(next_token_logits(model), dim=-1)
    assert out[0].token_ids == (int(logp.argmax()),)
    assert out[0].logprobs[0] == pytest.approx(float(logp.max()), abs=1e-4)


def test_top_p_keeps_the_smallest_set_that_reaches_the_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(top_p_filter(logits, 0.8))[0].tolist()
    assert kept == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert torch.isfinite(top_p_filter(logits, 0.81))[0].tolist() == [True, True, True, False]
    assert torch.isfinite(top_p_filter(logits, 0.1))[0].tolist() == [True, False, False, False]


def test_the_sampler_singles_out_the_token_it_drew():
    sampler = TokenSampler(temperature=1.0)
    torch.manual_seed(0)
    scores = torch.randn(3, 10)
    out = sampler(torch.zeros(3, 1, dtype=torch.long), scores)
    drawn = out.argmax(dim=-1)
    assert torch.isinf(out).sum() == 3 * 9  # one finite score per row
    assert torch.allclose(sampler.logprobs(3, scores.device)[:, 0],
                          torch.log_softmax(scores, dim=-1).gather(1, drawn[:, None]).squeeze(1))


def test_a_model_whose_defaults_would_change_the_distribution_is_refused():
    """A field the backend cannot neutralise (a suppressed token) would add a processor beside the sampler."""
    model = spread_model()
    model.generation_config.suppress_tokens = [7]
    config = generation_config(SamplingConfig(), max_new_tokens=1, pad_token_id=0, eos_token_id=(1,))
    with pytest.raises(ValueError, match="SuppressTokens.*generation_config.json"):
        check_sampling_is_ours(model, config)
    with pytest.raises(ValueError, match="SuppressTokens"):
        HFBackend(model, Tokenizer()).generate([PROMPT], SamplingConfig(max_tokens=1, stop=()))


def test_the_vllm_engine_samples_the_whole_distribution(vllm_backend, hf_backend):
    """The session's vLLM engine (SmolLM2, bf16) on a prompt whose next token is uncertain: more than 50
    distinct tokens, and log-probabilities that match the model's own full softmax on average (a truncated
    distribution would report every token as likelier than it is, by the log of the mass kept)."""
    tokenizer = vllm_backend.tokenizer
    prompt = tokenizer.encode("My favourite word in the whole English language is", add_special_tokens=False)
    vllm_backend.reseed(0)
    out = vllm_backend.generate([prompt] * 600, SamplingConfig(max_tokens=1, temperature=1.0, stop=()))
    tokens = [c.token_ids[0] for c in out]
    assert len(set(tokens)) > 50, len(set(tokens))
    expected = torch.log_softmax(next_token_logits(hf_backend.model, prompt), dim=-1)
    differences = [c.logprobs[0] - float(expected[c.token_ids[0]]) for c in out]
    assert abs(sum(differences) / len(differences)) < 0.05  # bf16 engines differ by ~0.05 per token, unbiased
    # Drawn from that distribution, not merely scored by it: a sampler that ignores it (a stale compiled kernel
    # drew tokens of probability 3e-4 where one held 0.998) still records true log-probabilities, but their
    # mean falls far below minus the entropy, the mean log-probability of honest draws.
    entropy = -float((expected.exp() * expected).sum())
    mean_logprob = sum(float(expected[t]) for t in tokens) / len(tokens)
    assert abs(mean_logprob + entropy) < 1.0, (mean_logprob, entropy)  # measured 0.13 apart (600 draws)


def peaked_argmax_sampler(logits: torch.Tensor) -> torch.Tensor:
    """A right sampler for the check's fixture (its rows hold all their mass on one token), drawing noise as a
    sampler does."""
    torch.rand(logits.shape)
    return logits.argmax(dim=-1)


@pytest.mark.parametrize("vocab", [49152, 40])
def test_the_cpu_sampler_check_passes_a_sampler_that_draws_from_the_distribution(vocab):
    state = torch.get_rng_state()
    assert check_cpu_sampler(vocab, peaked_argmax_sampler)
    assert torch.equal(torch.get_rng_state(), state)  # the trainer's stream is left where it was


@pytest.mark.parametrize("broken", [
    lambda logits: torch.full((logits.shape[0],), 33),  # one token whatever the distribution
    lambda logits: (logits.argmax(dim=-1) + 1) % logits.shape[1],  # next to the right one
    lambda logits: torch.where(logits.argmax(dim=-1) < 32, logits.argmax(dim=-1), 7),  # right below 32 only
])
def test_a_cpu_sampler_that_ignores_the_distribution_is_refused(broken):
    """The fault measured: a compiled sampler reused from a kernel cache of another instruction set drew the
    peak right at position 17 and wrong at 30, 44, 1000 and 49151."""
    with pytest.raises(SamplerBroken, match="TORCHINDUCTOR_CACHE_DIR"):
        check_cpu_sampler(49152, broken)


def test_the_vllm_engine_checked_its_own_sampler(vllm_backend):
    """The session's engine checked vLLM's compiled CPU sampler when it started (and would not have started
    had it failed); it passes again here, on the kernel the engine samples with. The pinned vLLM has the
    sampler where the check looks: a version that moved it would fail here, not go unchecked."""
    assert vllm_backend.sampler_checked
    assert check_cpu_sampler(49152)
