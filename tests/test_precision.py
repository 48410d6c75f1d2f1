"""bf16 training with fp32 masters: gradients summed over micro-batches in fp32, clipping on the fp32 sum,
and the precision chosen per device."""

from __future__ import annotations

import pytest
import torch

from eviback.train.precision import MasterWeightAdamW
from eviback.train.runner import Precision, training_precision


def pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    master = torch.nn.Linear(4, 1, bias=False)
    model = torch.nn.Linear(4, 1, bias=False).to(torch.bfloat16)
    return model, master


def backward(model: torch.nn.Module, scale: float) -> None:
    """A micro-batch whose gradient on every weight is exactly `scale`."""
    x = torch.ones(1, 4, dtype=torch.bfloat16)
    (model(x).sum() * scale).backward()


def test_micro_batch_gradients_are_summed_in_fp32():
    """bf16 keeps 8 significant bits: 256 + 1 rounds back to 256. A bf16 gradient buffer summing one
    large micro-batch and 64 small ones ends at 256; the fp32 sum is 320."""
    model, master = pair()
    MasterWeightAdamW(model, master, lr=0.0)
    backward(model, 256.0)
    for _ in range(64):
        backward(model, 1.0)
    assert model.weight.grad[0, 0].item() == 256.0  # what accumulating in the bf16 model loses

    model, master = pair()
    optimizer = MasterWeightAdamW(model, master, lr=0.0)
    backward(model, 256.0)
    optimizer.accumulate()
    for _ in range(64):
        backward(model, 1.0)
        optimizer.accumulate()
    assert model.weight.grad is None  # moved out after each micro-batch
    assert master.weight.grad.dtype == torch.float32
    assert torch.equal(master.weight.grad, torch.full((1, 4), 320.0))


def test_clipping_acts_on_the_fp32_sum_and_step_consumes_it():
    model, master = pair()
    optimizer = MasterWeightAdamW(model, master, lr=0.1, weight_decay=0.0)
    before = master.weight.detach().clone()
    backward(model, 3.0)
    optimizer.accumulate()
    norm = optimizer.clip_master_grads(1.0)
    assert norm.item() == pytest.approx(6.0)  # sqrt(4 * 3^2)
    assert torch.linalg.vector_norm(master.weight.grad).item() == pytest.approx(1.0, rel=1e-5)
    optimizer.step()
    assert master.weight.grad is None  # the next step accumulates afresh
    assert not torch.equal(master.weight, before)
    assert torch.equal(model.weight, master.weight.to(torch.bfloat16))  # rounded into the bf16 copy


def test_a_plain_loop_without_accumulate_still_steps():
    """step() takes whatever gradient is still on the model (e.g. a training loop without micro-batches)."""
    model, master = pair()
    optimizer = MasterWeightAdamW(model, master, lr=0.1)
    before = master.weight.detach().clone()
    backward(model, 1.0)
    optimizer.step()
    assert not torch.equal(master.weight, before)


def test_precision_per_device():
    assert training_precision("bfloat16", cuda=False) is Precision.MASTERS
    assert training_precision("bfloat16", cuda=True) is Precision.AUTOCAST
    assert training_precision("float32", cuda=False) is Precision.FLOAT32
    assert training_precision("float32", cuda=True) is Precision.FLOAT32


def test_log_probabilities_are_fp32_from_a_bf16_model():
    """The KL term and the importance ratio read log-probabilities: both of the trainer's paths (TRL's fused
    head and eviback's padding-free one) give them in fp32 from a bf16 model."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from eviback.train.update import padding_free_logprobs, score_plan

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, 64, (2, 8))
    attention = torch.ones_like(ids)
    fast = padding_free_logprobs(model, ids, score_plan(attention, 4))
    add_fused_lm_head(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=("log_probs",))
    trl = model(input_ids=ids, attention_mask=attention, labels=ids, fused_lm_head=True).log_probs
    assert trl.dtype == torch.float32 and fast.logps.dtype == torch.float32
