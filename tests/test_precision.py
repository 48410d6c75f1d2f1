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
