"""How the run was launched, read before any work: what `accelerate launch` told this process.

`accelerate launch` hands each process its choices in the environment (`ACCELERATE_USE_FSDP`,
`ACCELERATE_USE_DEEPSPEED`, `ACCELERATE_DEEPSPEED_ZERO_STAGE`, or a DeepSpeed config file). FSDP and DeepSpeed
ZeRO-3 shard the parameters themselves across the processes, so each process holds a slice of each weight, and
eviback's generation engines are refreshed from the trainer's `named_parameters()` after every step (a copy
of the policy, or a push into vLLM): they would get slices. That push does not gather shards yet, so such a
launch is refused at once, with the launch that works: ZeRO-2, which shards the gradients and the AdamW state
(the memory that matters, docs/training.md) and leaves every process whole weights.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping


def parameter_sharding(environ: Mapping[str, str]) -> str | None:
    """"FSDP" or "DeepSpeed ZeRO-3" when the launch shards the parameters, else None."""
    if _true(environ.get("ACCELERATE_USE_FSDP")):
        return "FSDP"
    if not _true(environ.get("ACCELERATE_USE_DEEPSPEED")):
        return None
    stage = environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    config_file = environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if stage is None and config_file:
        try:
            with open(config_file) as f:
                stage = str(json.load(f).get("zero_optimization", {}).get("stage", ""))
        except (OSError, ValueError, AttributeError):
            stage = None  # DeepSpeed itself says what is wrong with its file
    return "DeepSpeed ZeRO-3" if stage == "3" else None


def check_launch(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a launch whose parameters are sharded (see the module's text)."""
    sharding = parameter_sharding(os.environ if environ is None else environ)
    if sharding is not None:
        raise ValueError(
            f"this run was launched with {sharding}, which shards the parameters across the processes; eviback "
            "refreshes its generation engine from the trainer's parameters after every step and does not gather "
            "shards, so it would generate from slices of the weights. Launch with DeepSpeed ZeRO-2 instead "
            "(`accelerate launch --use_deepspeed --zero_stage 2 -m eviback.cli train ...`: the gradients and AdamW "
            "state are sharded, the weights stay whole; DeepSpeed is not part of eviback's setup: `pip install "
            "deepspeed`), or with plain data parallelism")


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")
