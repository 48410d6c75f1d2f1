"""The generation backends on the real SmolLM2: finish reasons, HF vs vLLM agreement, log-probabilities
that match a teacher-forced forward pass (what the trainer computes), reseeding, and pushing new weights
into the running vLLM engine."""

from __future__ import annotations

import pytest
import torch

from eviback.generation.base import FinishReason, SamplingConfig, stop_cut
from eviback.policy import load_tokenizer
from eviback.protocol import apply_chat_template

pytestmark = pytest.mark.slow

QUESTIONS = ["who wrote the origin of species", "what is the capital of france",
             "when did world war 2 end", "who painted the mona lisa"]


@pytest.fixture(scope="module")
def prompts():
    tokenizer = load_tokenizer("smollm2-135m")
    return [tokenizer(apply_chat_template(tokenizer, q), add_special_tokens=False)["input_ids"] for q in QUESTIONS]


def forward_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Teacher-forced log-probabilities of `completion` after `prompt`, shape (len(completion),)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


@pytest.mark.parametrize("which", ["vllm", "hf"])
def test_finish_reasons(which, prompts, request):
    backend = request.getfixturevalue(f"{which}_backend")
    tok = backend.tokenizer
    length, stop = backend.generate(
        prompts[:2], SamplingConfig(max_tokens=80, temperature=0, stop=(".",)), max_tokens=[4, 80])
    assert length.finish_reason is FinishReason.LENGTH and len(length.token_ids) == 4
    assert stop.finish_reason is FinishReason.STOP and "." in tok.decode(stop.token_ids[-1:])
    assert stop_cut(tok, list(stop.token_ids), (".",)) == len(stop.token_ids)  # nothing sampled after the stop
    assert stop.text == tok.decode(stop.token_ids, skip_special_tokens=True)
    assert len(stop.logprobs) == len(stop.token_ids) and all(lp <= 0 for lp in stop.logprobs)
    [eos] = backend.generate(prompts[1:2], SamplingConfig(max_tokens=300, temperature=0, stop=()))
    assert eos.finish_reason is FinishReason.EOS and eos.token_ids[-1] == tok.eos_token_id


def test_hf_and_vllm_greedy_agree(vllm_backend, hf_backend, prompts):
    params = SamplingConfig(max_tokens=32, temperature=0, stop=())
    fast = vllm_backend.generate(prompts, params)
    ref = hf_backend.generate(prompts, params)
    same_start = sum(a.token_ids[:12] == b.token_ids[:12] for a, b in zip(fast, ref, strict=True))
    assert same_start >= 3, [(a.text, b.text) for a, b in zip(fast, ref, strict=True)]  # bf16: close, not bitwise
    for a, b in zip(fast, ref, strict=True):
        common = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y),
                      min(len(a.token_ids), len(b.token_ids)))
        diff = torch.tensor(a.logprobs[:common]) - torch.tensor(b.logprobs[:common])
        assert diff.abs().mean() < 0.15


@pytest.mark.parametrize("which", ["vllm", "hf"])
def test_sampled_logprobs_match_a_forward_pass(which, prompts, hf_backend, request):
    """The trainer recomputes log-probabilities with a forward pass; the engine's must track them."""
    backend = request.getfixturevalue(f"{which}_backend")
    backend.reseed(0)
    outs = backend.generate(prompts, SamplingConfig(max_tokens=24, temperature=1.0, stop=()))
    diffs = []
    for prompt, out in zip(prompts, outs, strict=True):
        ref = forward_logprobs(hf_backend.model, prompt, list(out.token_ids))
        diffs.append((torch.tensor(out.logprobs) - ref).abs())
    assert torch.cat(diffs).mean() < 0.1


@pytest.mark.parametrize("which", ["vllm", "hf"])
def test_reseed_makes_sampling_reproducible(which, prompts, request):
    backend = request.getfixturevalue(f"{which}_backend")
    params = SamplingConfig(max_tokens=16, temperature=1.0, stop=())
    runs = []
    for seed in (3, 3, 4):
        backend.reseed(seed)
        runs.append([o.token_ids for o in backend.generate(prompts, params)])
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.parametrize("which", ["vllm", "hf"])
def test_sampling_leaves_the_global_rng_alone(which, prompts, request):
    """A trainer sharing the process keeps its own random stream: neither reseeding nor sampling moves
    torch's global RNG, and sampling still differs between two calls without a reseed."""
    backend = request.getfixturevalue(f"{which}_backend")
    params = SamplingConfig(max_tokens=8, temperature=1.0, stop=())
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    backend.reseed(7)
    first = [o.token_ids for o in backend.generate(prompts, params)]
    second = [o.token_ids for o in backend.generate(prompts, params)]
    assert torch.equal(torch.rand(4), expected)
    assert first != second  # the backend's own stream advanced


def test_weight_push_into_running_vllm(vllm_backend, hf_backend, prompts):
    params = SamplingConfig(max_tokens=24, temperature=0, stop=())
    before = [o.token_ids for o in vllm_backend.generate(prompts, params)]
    original = {k: v.clone() for k, v in hf_backend.model.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    # 10% relative noise: outputs change, yet the model stays well-conditioned enough for bf16 to agree
    perturbed = {k: (v.float() * (1 + 0.1 * torch.randn(v.shape, generator=generator))).to(v.dtype)
                 if "proj" in k else v for k, v in original.items()}
    try:
        vllm_backend.update_weights(perturbed)
        hf_backend.update_weights(perturbed)
        after = vllm_backend.generate(prompts, params)
        assert [o.token_ids for o in after] != before
        # the engine now computes with the pushed weights: its log-probs track a forward pass of them
        diffs = [(torch.tensor(o.logprobs) - forward_logprobs(hf_backend.model, p, list(o.token_ids))).abs()
                 for p, o in zip(prompts, after, strict=True)]
        assert torch.cat(diffs).mean() < 0.1
        # a trainer's fp32 master weights load into the bf16 engine too
        vllm_backend.update_weights((k, v.float()) for k, v in original.items())
        assert [o.token_ids for o in vllm_backend.generate(prompts, params)] == before
    finally:
        vllm_backend.update_weights(original)
        hf_backend.update_weights(original)
    assert [o.token_ids for o in vllm_backend.generate(prompts, params)] == before


def test_engine_leaves_thread_control_to_the_process(vllm_backend):
    """vLLM's CPU worker disables torch.set_num_threads process-wide; the backend puts it back (an
    in-process trainer must keep control of its threads)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
