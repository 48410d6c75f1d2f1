"""The HF engine's GPU path, checked on the CPU: whole-turn batches, stop strings found on token ids (the
same cut as decoding finds), the grouped decoding attention (the same attention as transformers' SDPA), and
a static KV cache (the same tokens)."""

from __future__ import annotations

import random

import pytest
import torch

from eviback.generation.base import FinishReason, SamplingConfig, stop_cut
from eviback.generation.hf import HFBackend
from eviback.generation.stops import StopMatcher
from eviback.protocol import STOP_STRINGS


@pytest.fixture(scope="module")
def tokenizer():
    from eviback.policy import load_tokenizer

    return load_tokenizer("smollm2-135m", "float32")


def tiny_gqa_model(tokenizer, seed: int = 0) -> torch.nn.Module:
    """2 layers of a Qwen3-like shape (4 query heads on 2 KV heads), the tokenizer's vocabulary, fp32."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    # Larger logits than the default init gives, so that greedy choices are far apart (no ties by rounding)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(20)
    return model


def test_stop_matcher_cuts_where_decoding_does(tokenizer):
    matcher = StopMatcher.for_tokenizer(tokenizer, STOP_STRINGS)
    rng = random.Random(0)
    pieces = ["</search>", "</answer>", "</", "search>", "answer>", "<", ">", " </sea", "rch>", "<answer> x </answer>"]
    vocab = len(tokenizer)
    for _ in range(500):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        for _ in range(rng.randrange(0, 3)):
            at = rng.randrange(len(ids) + 1)
            ids[at:at] = tokenizer.encode(rng.choice(pieces), add_special_tokens=False)
        assert matcher.first_stop(ids) == stop_cut(tokenizer, ids, STOP_STRINGS), tokenizer.decode(ids)


def test_stop_matcher_on_texts():
    texts = ["a", "<", "/", "s", "</", "search", ">", "</search>", "x>", "answer>."]
    m = StopMatcher(texts, ("</search>",))
    assert m.first_stop([1, 2, 5, 6]) == 4  # "<" "/" "search" ">"
    assert m.first_stop([4, 5, 6, 0]) == 3
    assert m.first_stop([7]) == 1
    assert m.first_stop([4, 5, 0, 6]) is None  # "</searcha>" holds no stop string
    assert m.first_stop([1, 4, 5, 6]) == 4  # "<</search>": the second "<" starts it
    with pytest.raises(ValueError, match="stop string"):
        StopMatcher(texts, ())


def test_grouped_decode_attention_equals_sdpa(tokenizer):
    """The same logits at every decoding step of a left-padded batch as transformers' SDPA attention."""
    from eviback.generation.attention import GROUPED, use_grouped_decode_attention

    reference, grouped = tiny_gqa_model(tokenizer), tiny_gqa_model(tokenizer)
    assert use_grouped_decode_attention(grouped) and grouped.config._attn_implementation == GROUPED
    prompts = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    outs = []
    for model in (reference, grouped):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        outs.append(out)
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b in zip(outs[0].logits, outs[1].logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_whole_turn_batch_gives_the_micro_batches_tokens(tokenizer):
    """One generate call for all prompts (the GPU setting) samples, greedily, the tokens the CPU's micro-batches
    do, with the same finish reasons and the stop strings cut on token ids."""
    model = tiny_gqa_model(tokenizer, seed=1)
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in
               ("Question: who wrote Hamlet? <search>", "The capital of France is", "<answer>", "x " * 40)]
    params = SamplingConfig(max_tokens=24, temperature=0)
    micro = HFBackend(model, tokenizer, batch_size=1).generate(prompts, params)
    whole = HFBackend(model, tokenizer, batch_size=None, grouped_attention=True)
    assert whole.batch_size is None or whole.batch_size == 16  # CPU: micro-batches unless asked otherwise
    whole.batch_size = None
    together = whole.generate(prompts, params)
    assert [c.token_ids for c in together] == [c.token_ids for c in micro]
    assert [c.finish_reason for c in together] == [c.finish_reason for c in micro]
    for a, b in zip(together, micro, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_stop_strings_end_generation_on_ids(tokenizer):
    """A model made to say "</search>" at once stops on the token that completes it, with the reason STOP."""
    model = tiny_gqa_model(tokenizer, seed=2)
    target = tokenizer.encode(" </search> more text", add_special_tokens=False)
    # Bias the head so that, whatever the input, the next token is the next one of `target` (a fixed text).
    backend = HFBackend(model, tokenizer, batch_size=None)

    class Scripted(torch.nn.Module):
        def forward(self, hidden):
            logits = torch.full(hidden.shape[:-1] + (len(tokenizer),), -1e4)
            step = Scripted.step
            logits[..., target[min(step, len(target) - 1)]] = 1e4
            Scripted.step += 1
            return logits

    Scripted.step = 0
    original = model.lm_head
    model.lm_head = Scripted()
    try:
        [completion] = backend.generate([[5, 6, 7]], SamplingConfig(max_tokens=12, temperature=0))
    finally:
        model.lm_head = original
    assert completion.finish_reason is FinishReason.STOP
    assert completion.token_ids == tuple(target[: stop_cut(tokenizer, target, STOP_STRINGS)])
    assert "</search>" in completion.text and "more" not in completion.text


def test_static_cache_gives_the_dynamic_caches_tokens(tokenizer):
    model = tiny_gqa_model(tokenizer, seed=3)
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in ("one two three", "four", "five six")]
    params = SamplingConfig(max_tokens=10, temperature=0)
    dynamic = HFBackend(model, tokenizer, batch_size=None).generate(prompts, params)
    for grouped in (False, True):
        static = HFBackend(model, tokenizer, batch_size=None, cache="static",
                           grouped_attention=grouped).generate(prompts, params)
        assert [c.token_ids for c in static] == [c.token_ids for c in dynamic]


def test_backend_options_are_checked(tokenizer):
    model = tiny_gqa_model(tokenizer)
    with pytest.raises(ValueError, match="cache must be"):
        HFBackend(model, tokenizer, cache="paged")
    with pytest.raises(ValueError, match="compile=True needs"):
        HFBackend(model, tokenizer, compile=True)
    with pytest.raises(ValueError, match="batch_size"):
        HFBackend(model, tokenizer, batch_size=0)
    cpu = HFBackend(model, tokenizer)
    assert cpu.batch_size == 16 and not cpu.accelerator and not cpu.grouped_attention


def test_inputs_follow_the_model(tokenizer, monkeypatch):
    """Every tensor handed to `generate` is on the model's device."""
    model = tiny_gqa_model(tokenizer)
    backend = HFBackend(model, tokenizer)
    seen = []
    original = model.generate

    def spy(**kwargs):
        seen.extend(v.device for v in kwargs.values() if isinstance(v, torch.Tensor))
        return original(**kwargs)

    monkeypatch.setattr(model, "generate", spy)
    backend.generate([[5, 6]], SamplingConfig(max_tokens=3, temperature=0))
    assert seen and all(d == backend.device for d in seen)
