"""The fast update (eviback.train.update) computes TRL's log-probabilities, loss and gradients.

Unit tests pin the score plan's layout and the chunked LM head against a plain log-softmax; the trainer
test runs TRL's own `_compute_loss` on one batch twice (TRL's padded path, then the fast path) on a tiny
random llama and compares the loss, the reference log-probabilities and every parameter's gradient."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from eviback.train.update import length_buckets, padding_free_logprobs, score_plan, token_logprobs

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def test_score_plan_follows_trls_layout():
    # 2 rows: prompts left-padded to 3, completions right-padded to 4 (C = 4)
    attention = torch.tensor([[0, 1, 1, 1, 1, 1, 0],
                              [1, 1, 1, 1, 1, 1, 1]])
    score = torch.tensor([[1, 0, 0, 0],   # row 0: first completion token only
                          [1, 1, 0, 1]])  # row 1: an observation at position 2
    plan = score_plan(attention, 4, score)
    assert plan.rows == ((0, 1, 6), (1, 0, 7))
    assert plan.target_column.tolist() == [3, 3, 4, 6]
    assert plan.out_index.tolist() == [0, 4, 5, 7]
    # hidden states are concatenated per row (5 then 7 real tokens); the state before the target predicts it
    assert plan.hidden_index.tolist() == [3 - 1 - 1, 5 + 2, 5 + 3, 5 + 5]
    assert plan.tokens == 4 and plan.run_tokens == 12


def test_score_plan_skips_rows_without_scored_tokens_and_refuses_holes():
    attention = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1]])
    plan = score_plan(attention, 2, torch.tensor([[0, 0], [0, 1]]))
    assert [r[0] for r in plan.rows] == [1] and plan.run_tokens == 4
    assert score_plan(torch.tensor([[1, 0, 1, 1]]), 2) is None


def test_length_buckets_bound_the_padding_and_the_budget():
    lengths = [100, 95, 50, 90, 48, 10]
    assert length_buckets(lengths, token_budget=1000, max_padding=0.1) == [[0, 1, 3], [2, 4], [5]]
    assert length_buckets(lengths, token_budget=200, max_padding=0.1) == [[0, 1], [3], [2, 4], [5]]
    assert length_buckets(lengths, token_budget=10_000, max_padding=0.0) == [[0], [1], [3], [2], [4], [5]]
    for bucket in length_buckets(lengths, token_budget=250, max_padding=0.3):
        padded = lengths[bucket[0]] * len(bucket)
        assert padded <= 250 or len(bucket) == 1
        assert padded - sum(lengths[i] for i in bucket) <= 0.3 * padded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keep_bytes", [1 << 30, 0])  # logits kept for the backward / recomputed
def test_chunked_head_matches_log_softmax(dtype, keep_bytes):
    torch.manual_seed(0)
    n, h, v, temperature = 37, 16, 101, 0.7
    hidden = torch.randn(n, h, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, h, dtype=dtype, requires_grad=True)
    target = torch.randint(0, v, (n,))
    upstream = torch.randn(n)

    logps, entropy = token_logprobs(hidden, weight, target, temperature=temperature, chunk_tokens=8,
                                    keep_logits_bytes=keep_bytes)
    (logps * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    # reference: the full (N, V) logits in the same dtype, soft-maxed in fp32
    logits = (hidden @ weight.t()).float() / temperature
    log_p = torch.log_softmax(logits, dim=-1)
    ref = log_p.gather(1, target[:, None]).squeeze(1)
    ref_entropy = -(log_p.exp() * log_p).sum(-1)
    (ref * upstream).sum().backward()

    assert logps.dtype == torch.float32 and entropy.dtype == torch.float32
    torch.testing.assert_close(logps, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy.detach(), rtol=1e-4, atol=1e-4)  # log Z - E[z]: cancels
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for ours, theirs in zip(grads, (hidden.grad, weight.grad), strict=True):
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=tol, atol=tol)


def test_nothing_scored_still_backpropagates():
    model = _tiny_llama(torch.float32)
    plan = score_plan(torch.ones(1, 6, dtype=torch.long), 3, torch.zeros(1, 3))
    out = padding_free_logprobs(model, torch.randint(0, 50, (1, 6)), plan)
    assert out.scored_tokens == 0 and out.logps.shape == (1, 3)
    out.logps.sum().backward()  # no error; zero gradient
    assert float(model.get_output_embeddings().weight.grad.abs().sum()) == 0.0


# --------------------------------------------------------------------------------------------------
# TRL's loss, plain and fast, on one batch


def _tiny_llama(dtype: torch.dtype, vocab: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=2, eos_token_id=2, bos_token_id=1)
    return LlamaForCausalLM(config).to(dtype)


def _tokenizer(vocab: int):
    """A word-level tokenizer over the tiny model's vocabulary (GRPOTrainer wants a real one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2",
                                   pad_token="t2")


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    """4 rows like a rollout's: prompts of different lengths (left-padded), completions of different
    lengths (right-padded) with observation spans masked out by `tool_mask`."""
    torch.manual_seed(1)
    prompts, completions, tools = [9, 6, 11, 7], [14, 25, 5, 19], []
    p_len, c_len = max(prompts), max(completions)
    prompt_ids = torch.full((4, p_len), 2)
    prompt_mask = torch.zeros(4, p_len, dtype=torch.long)
    completion_ids = torch.full((4, c_len), 2)
    completion_mask = torch.zeros(4, c_len, dtype=torch.long)
    tool_mask = torch.ones(4, c_len, dtype=torch.long)
    for b, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        prompt_ids[b, p_len - p:] = torch.randint(3, vocab, (p,))
        prompt_mask[b, p_len - p:] = 1
        completion_ids[b, :c] = torch.randint(3, vocab, (c,))
        completion_mask[b, :c] = 1
        if c > 8:
            tool_mask[b, 4:8] = 0  # an observation
        tools.append(tool_mask[b, :c].tolist())
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "tool_mask": tool_mask,
            "advantages": torch.tensor([1.0, -0.5, 0.25, -0.75]),
            # the behaviour-policy correction's per-token weights (TRL's vLLM path), not all 1
            "importance_sampling_ratio": 0.5 + torch.rand(4, c_len),
            "num_items_in_batch": (completion_mask * tool_mask).sum(), "_tools": tools}


def _trainer(tmp_path, dtype: torch.dtype):
    from trl import GRPOConfig

    from eviback.backoff import BackoffConfig
    from eviback.train.grpo import EviBackTrainer, training_dataset
    from eviback.types import Question

    model = _tiny_llama(dtype)
    model.save_pretrained(tmp_path / "model")  # TRL builds the reference model from this path
    model.config._name_or_path = str(tmp_path / "model")
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                      gradient_accumulation_steps=1, num_generations=4, max_steps=1, beta=0.04,
                      loss_type="dapo", temperature=0.8, use_cpu=True, bf16=False, report_to="none",
                      save_strategy="no", remove_unused_columns=False, disable_tqdm=True)
    questions = [Question("q", "what is it", ("x",))]
    trainer = EviBackTrainer(engine=None, questions={}, backoff=BackoffConfig(), judge_groups=None,
                             on_step=lambda _: None, push_weights=False, model=model, args=args,
                             train_dataset=training_dataset(questions), processing_class=_tokenizer(model.config.vocab_size))
    trainer.current_gradient_accumulation_steps = 1
    model.train()
    return trainer, model


def _loss_and_grads(trainer, model, batch, fast: bool):
    trainer.scoring = dataclasses.replace(trainer.scoring, padding_free=fast)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    keep = batch["completion_ids"].shape[1]
    trainer._scoring_state.rollout_masks = batch["_tools"]  # as `_generate` leaves them for the no-grad passes
    with torch.no_grad():
        ref, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, attention, keep,
                                                                batch_size=4)
    inputs = {k: v for k, v in batch.items() if k != "_tools"} | {"ref_per_token_logps": ref}
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    mask = batch["completion_mask"] * batch["tool_mask"]
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    return loss.detach().float(), ref * mask, trainer._metrics["train"]["entropy"][-1], grads, ref


@pytest.mark.parametrize("dtype, tol, max_padding", [(torch.float32, 1e-5, 0.2), (torch.float32, 1e-5, 0.0),
                                                     (torch.bfloat16, 2e-2, 0.2)])
def test_fast_update_gives_trls_loss_and_gradients(tmp_path, dtype, tol, max_padding):
    trainer, model = _trainer(tmp_path, dtype)
    assert trainer.ref_model.dtype == model.dtype  # TRL builds the reference in the policy's dtype (runner passes none)
    trainer.scoring = dataclasses.replace(trainer.scoring, max_padding=max_padding)  # 0.2: rows of the batch share right-padded decoder batches
    with torch.no_grad():  # move the policy off the reference so that the KL term is not zero
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    batch = _batch(model.config.vocab_size)
    plain = _loss_and_grads(trainer, model, batch, fast=False)
    fast = _loss_and_grads(trainer, model, batch, fast=True)

    assert abs(float(plain[0])) > 1e-3  # a loss that exercises the policy and KL terms
    observation = batch["tool_mask"] == 0
    assert (fast[4][observation] == 0).all() and (plain[4][observation] != 0).any()  # the fast path ran
    torch.testing.assert_close(fast[0], plain[0], rtol=tol, atol=tol)
    torch.testing.assert_close(fast[1], plain[1], rtol=tol, atol=tol)  # reference log-probs (fp32)
    assert fast[1].dtype == torch.float32
    assert fast[2] == pytest.approx(plain[2], rel=tol, abs=tol)  # the logged entropy
    for name, g in plain[3].items():
        assert g.abs().sum() > 0, name
        err = (fast[3][name] - g).norm() / g.norm()
        assert err < tol, (name, float(err))


class MatmulDtypes:
    """Records the dtype of every matrix product dispatched inside the block."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        seen = self.seen = []
        products = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func in products:
                    seen.append(args[-1].dtype)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


@pytest.mark.parametrize("kept", [False, True])
def test_the_chunked_head_computes_in_the_autocast_dtype_in_both_passes(kept):
    """fp32 weights under bf16 autocast (the trainer on a GPU): the head's forward and backward matmuls all run
    in bf16, so the backward's probabilities are the forward's; its gradients equal autograd's through the same
    bf16 logits. Logits that fit `keep_logits_bytes` in bf16 are kept for the backward (two products a chunk
    there, not three)."""
    torch.manual_seed(0)
    n, hidden_size, vocab, chunk = 6, 16, 40, 4
    hidden = torch.randn(n, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    target = torch.randint(0, vocab, (n,))
    keep = n * vocab * 2 if kept else 0  # exactly the bf16 logits
    with torch.autocast("cpu", dtype=torch.bfloat16), MatmulDtypes() as forward:
        logps, _ = token_logprobs(hidden, weight, target, temperature=0.8, chunk_tokens=chunk, keep_logits_bytes=keep)
    with MatmulDtypes() as backward:
        logps.sum().backward()
    chunks = -(-n // chunk)
    assert forward.seen == [torch.bfloat16] * chunks
    assert backward.seen == [torch.bfloat16] * ((2 if kept else 3) * chunks)
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    z = (h.bfloat16() @ w.bfloat16().t()).float() / 0.8
    torch.log_softmax(z, dim=-1).gather(1, target[:, None]).sum().backward()
    torch.testing.assert_close(logps.detach(), torch.log_softmax(z, dim=-1).gather(1, target[:, None]).squeeze(1).detach(),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(hidden.grad, h.grad, rtol=0.02, atol=0.02)
    torch.testing.assert_close(weight.grad, w.grad, rtol=0.02, atol=0.02)
