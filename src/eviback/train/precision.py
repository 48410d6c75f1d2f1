"""bf16 training with fp32 master weights, for CPUs with bf16 instructions.

The forward and backward passes run on a bf16 copy of the model (about twice as fast as fp32 here); the
optimiser updates fp32 master weights and rounds them back into the bf16 copy after each step. Updating
bf16 weights directly loses small updates: bf16 keeps 8 bits of mantissa, so near a weight of 0.05 it
cannot represent a change smaller than ~2e-4, and most updates of lr 1e-4 vanish.
"""

from __future__ import annotations

import torch


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW over the fp32 `master` copy of a bf16 `model`.

    `model` and `master` are the same architecture (same parameter names). Each `step()` copies the bf16
    gradients into the masters as fp32, runs AdamW on the masters, and copies them back into `model`. The
    learning-rate scheduler and gradient clipping act as usual (clipping on the bf16 gradients, before
    the step). After training, `master` holds the trained weights at full precision."""

    def __init__(self, model: torch.nn.Module, master: torch.nn.Module, **kwargs) -> None:  # noqa: ANN003
        ours = dict(model.named_parameters())
        theirs = dict(master.named_parameters())
        if ours.keys() != theirs.keys():
            raise ValueError("the bf16 model and its fp32 master copy must have the same parameter names")
        self.pairs = [(ours[name], theirs[name]) for name in ours if ours[name].requires_grad]
        for _, m in self.pairs:
            m.requires_grad_(False)  # gradients are copied in, never computed on the masters
        # The fused kernel does AdamW in one pass over memory (~7x faster than the default on CPU).
        kwargs.setdefault("fused", True)
        super().__init__([m for _, m in self.pairs], **kwargs)
        self.sync_to_model()

    @torch.no_grad()
    def sync_to_model(self) -> None:
        """Round the masters into the bf16 model."""
        for p, m in self.pairs:
            p.copy_(m)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        for p, m in self.pairs:
            if p.grad is None:
                m.grad = None  # no gradient this step: AdamW skips the parameter
            elif m.grad is None:
                m.grad = p.grad.to(torch.float32)  # allocated once, then reused (0.5 GB for 135M)
            else:
                m.grad.copy_(p.grad)
        loss = super().step(closure)
        self.sync_to_model()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The masters' gradient buffers are kept (overwritten at each step); only the model's are cleared.
        for p, _ in self.pairs:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
