"""fp32 master weights and checkpoints in TRL's trainer (trl==1.16.0 on transformers' `Trainer`).

When training runs in bf16 on a CPU, the model computes in bf16 and :class:`MasterWeightAdamW` updates an fp32
master copy (:mod:`eviback.train.precision`). This unit wires that optimiser into the trainer's loop: each
micro-batch's bf16 gradients go into the fp32 sum at once, clipping and the logged gradient norm read the
fp32 sums, and every checkpoint holds the masters, so a resumed run continues from the exact fp32 weights.
It also loads a multi-process CPU run's optimiser state where transformers cannot. A trainer without a
master (`master=None`: fp32, or a GPU under autocast) runs transformers' own code everywhere.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors.torch import save_model
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
from trl import GRPOTrainer

from eviback.train.precision import MasterWeightAdamW

MASTER_WEIGHTS = "master.safetensors"  # the fp32 master weights inside a checkpoint (bf16 training)


class MasterWeights(GRPOTrainer):
    """`GRPOTrainer` with fp32 masters: pass `master` (the fp32 copy :class:`MasterWeightAdamW` updates) and
    that optimiser in `optimizers`; with `master=None` nothing changes."""

    def __init__(self, *args: Any, master: torch.nn.Module | None = None, **kwargs: Any) -> None:
        self.master = master
        super().__init__(*args, **kwargs)

    def _master_optimizer(self) -> MasterWeightAdamW | None:
        if self.master is None:
            return None
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it
        return optimizer if isinstance(optimizer, MasterWeightAdamW) else None

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        optimizer = self._master_optimizer()
        if optimizer is not None:
            # Each micro-batch's bf16 gradients go into the fp32 sum at once, so the accumulation over
            # micro-batches never rounds to bf16.
            optimizer.accumulate(reduce_earlier=self.accelerator.sync_gradients)
        return loss

    def _clip_grad_norm(self, model: Any) -> Any:
        optimizer = self._master_optimizer()
        if optimizer is None:
            return super()._clip_grad_norm(model)
        return optimizer.clip_master_grads(self.args.max_grad_norm)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        optimizer = self._master_optimizer()
        if optimizer is None or grad_norm is not None:
            return super()._get_grad_norm(model, grad_norm=grad_norm)
        return optimizer.master_grad_norm()

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # The fp32 masters go in first: transformers writes trainer_state.json last, so a checkpoint that
        # looks complete always has them.
        if self.master is not None and self.args.should_save:
            folder = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
            os.makedirs(folder, exist_ok=True)
            save_model(self.master, os.path.join(folder, MASTER_WEIGHTS))
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # transformers loads a multi-process run's optimizer state with `map_location=args.device`, which on
        # CPU is `cpu:0`, a location torch.load cannot restore to ("don't know how to restore data location
        # ... cpu:0"): an fp32 run of several CPU processes failed to resume (tests/test_train_multiprocess.py
        # with dtype float32, what `auto` picks on a CPU without native bf16). CPU state loads onto "cpu".
        optimizer_file = os.path.join(checkpoint or "", OPTIMIZER_NAME)
        scheduler_file = os.path.join(checkpoint or "", SCHEDULER_NAME)
        if (checkpoint is None or self.args.device.type != "cpu" or self.args.world_size <= 1
                or self.is_deepspeed_enabled or self.is_fsdp_enabled
                or not (os.path.isfile(optimizer_file) and os.path.isfile(scheduler_file))):
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.optimizer.load_state_dict(torch.load(optimizer_file, map_location="cpu", weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(scheduler_file, map_location="cpu", weights_only=True))
        return None
