"""Memory planning for a training run: what the trainer keeps on its device, and the heap it gives back.

The generation engines' arithmetic (KV caches, the vLLM CPU engine's cache, the share of a GPU an in-process
engine takes) is :mod:`eviback.generation.memory`'s; this module adds the trainer's side, which the runner
sets against it.

The trainer's bytes per parameter (docs/training.md, "Memory"): on a GPU (fp32 weights under bf16 autocast)
4 for the weights, 8 for AdamW's two moments, 4 for the reference model when the KL term is on (it computes
exactly as the policy does: fp32 under the same autocast), all resident while the engine generates; the
update adds 4 for the gradients and 2 for autocast's bf16 copy of the weights, plus activations. On the CPU
(a bf16 model with fp32 masters) 2 + 4 + 8 (+ 2 for a bf16 reference), and the same gradients.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerBytes:
    """Bytes per parameter the trainer holds, by phase."""

    resident: int  # while the engine generates: weights (and masters), AdamW's moments, the reference model
    update: int  # added during the update: gradients and autocast's weight copy (activations come on top)

    def resident_bytes(self, parameters: int) -> int:
        return self.resident * parameters

    def peak_bytes(self, parameters: int) -> int:
        """The update's peak without activations."""
        return (self.resident + self.update) * parameters


def trainer_bytes(*, accelerator: bool, masters: bool, reference: bool) -> TrainerBytes:
    """The trainer's bytes per parameter on a GPU (`accelerator`: fp32 weights under bf16 autocast) or a CPU
    (`masters`: a bf16 model with fp32 masters; else fp32), with a reference model when `reference` (beta > 0).
    Fused AdamW on a GPU updates in place: no transient copy of a parameter group."""
    if accelerator:
        return TrainerBytes(resident=4 + 8 + (4 if reference else 0), update=4 + 2)
    if masters:
        return TrainerBytes(resident=2 + 4 + 8 + (2 if reference else 0), update=2 + 4)
    return TrainerBytes(resident=4 + 8 + (4 if reference else 0), update=4)


def release_free_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's `malloc_trim`); False where unavailable.

    Tensors of a training step come and go in many sizes; glibc keeps freed blocks in its arenas, so without
    this a long run's resident memory grows step after step although the live tensors do not."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True
