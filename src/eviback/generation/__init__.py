"""Generation engines behind one contract (`base.GenerationBackend`): vLLM in this process (default), HF
`generate`, and a `vllm serve` process reached over HTTP (`vllm-server`, TRL's server mode: `server.py`).

    from eviback.generation import BackendConfig, load_backend
    backend = load_backend(BackendConfig(backend="vllm", model="smollm2-135m"))

vLLM engines are cached per process (starting one takes about a minute); an HF backend is a plain object
that can also wrap a model you already hold (`HFBackend(model, tokenizer)`).

The engines' modules (torch, transformers, vLLM) are imported by :func:`load_backend`, for the engine it
starts: a configuration that names an engine does not load one.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from eviback import device as devices
from eviback import dtype as dtypes
from eviback.generation.base import (
    EXECUTORS,
    HF_CACHES,
    SLEEP_LEVELS,
    Completion,
    FinishReason,
    GenerationBackend,
    SamplingConfig,
)
from eviback.generation.server import DEFAULT_URL, ServerConfig, VllmServerBackend
from eviback.generation.server import NAME as VLLM_SERVER
from eviback.policy import DEFAULT_MODEL
from eviback.settings import check_fields

BACKENDS = ("vllm", "hf", VLLM_SERVER)


@dataclass(frozen=True)
class EngineSettings:
    """How a command's generation engine runs, beyond which engine (`backend`) and on what model: the settings
    `eviback train` (as a section, set by these names) and `eviback eval` share, declared once."""

    policy_url: str = field(default=DEFAULT_URL, metadata={"help": "backend=vllm-server: the policy server's base URL"})
    policy_timeout_s: float = field(default=600.0, metadata={"help": "backend=vllm-server: seconds one generation "
                                    "request may take before the command stops (its work so far is kept)"})
    gpu_memory_utilization: float | None = field(default=None, metadata={"help": "backend=vllm on a CUDA GPU: the "
                                                 "share of the GPU's memory the engine takes (weights, activations, "
                                                 "KV cache). None: training plans it from the model and one step's "
                                                 "rollouts, leaving the trainer what it keeps on the GPU "
                                                 "(docs/training.md, 'Memory'); evaluation takes 0.85"})
    sleep_level: int = field(default=2, metadata={"help": "backend=vllm on a CUDA GPU: what the engine gives back "
                             "during the update: 2 its weights and KV cache (the next push brings new weights), 1 its "
                             "KV cache, keeping the weights in CPU memory"})
    executor: str = field(default="inprocess", metadata={"help": "backend=vllm: inprocess (the weight push, reseed), "
                          "multiprocess, or external_launcher (one engine per process of a torchrun/accelerate "
                          "launch, TRL's colocate mode)"})

    def __post_init__(self) -> None:
        check_fields(self)
        self.server_config()  # checks the URL and the timeout
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization is a share of the GPU's memory, in (0, 1], or None to plan it; "
                             f"got {self.gpu_memory_utilization}")
        if self.sleep_level not in SLEEP_LEVELS:
            raise ValueError(f"vllm_sleep_level must be 1 or 2, got {self.sleep_level}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"unknown executor {self.executor!r}; choose one of {', '.join(EXECUTORS)}")

    def server_config(self) -> ServerConfig:
        """How to reach the policy server (backend vllm-server)."""
        return ServerConfig(url=self.policy_url, timeout_s=self.policy_timeout_s)


@dataclass(frozen=True)
class BackendConfig:
    """Which generation engine to run a policy on, and how."""

    backend: str = field(default="vllm", metadata={"help": "vllm (in this process: fast, prefix caching, weight "
                         "push), hf (transformers generate) or vllm-server (a `vllm serve` process at policy_url)"})
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "model name (see eviback.policy) or local checkpoint dir"})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 where the device computes it natively, else "
                       "fp32: eviback.dtype), bfloat16, float32 or float16"})
    device: str = field(default="auto", metadata={"help": devices.HELP})
    max_model_len: int = field(default=4096, metadata={"help": "vllm: longest prompt + completion"})
    kv_cache_gib: float | None = field(default=None, metadata={"help": "vllm on CPU: KV cache GiB (default: $VLLM_CPU_KVCACHE_SPACE or 2)"})
    block_size: int | None = field(default=None, metadata={"help": "vllm: KV cache block in tokens, the prefix cache's unit (None: vLLM's default)"})
    hf_batch_size: int | None = field(default=None, metadata={"help": "hf: sequences per generate call (None: 16 on "
                                      "the CPU; on a GPU as few calls as its free memory holds)"})
    hf_cache: str = field(default="auto", metadata={"help": "hf: KV cache, dynamic or static (auto: static on a GPU, "
                          "dynamic on the CPU)"})
    threads: int | None = field(default=None, metadata={"help": "torch threads (None: the backend's default: vllm 1 while generating, hf torch's own)"})
    engine: EngineSettings = field(default_factory=EngineSettings, metadata={"help": "the engine's own settings "
                                   "(policy server, GPU memory share, sleep level, executor)"})

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if not isinstance(self.engine, EngineSettings):
            raise ValueError(f"BackendConfig.engine must be an EngineSettings, got {type(self.engine).__name__}")
        dtypes.check(self.dtype)
        devices.check_device(self.device)
        # the engine's own config checks these again when it starts; here they are refused before any work
        if self.max_model_len < (256 if self.backend == "vllm" else 1):
            raise ValueError(f"max_model_len must be >= 256 for vllm (a Search-R1 prompt alone is longer; use "
                             f">= 1024) and >= 1 for hf, got {self.max_model_len}")
        if self.hf_cache not in HF_CACHES:
            raise ValueError(f"hf_cache must be one of {', '.join(HF_CACHES)}, got {self.hf_cache!r}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be > 0 (GiB), or None for the engine's default, got {self.kv_cache_gib}")
        for name in ("block_size", "hf_batch_size", "threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, or None for the backend's default, got {value}")


def load_backend(config: BackendConfig | None = None) -> GenerationBackend:
    """The backend `config` names: the process's cached vLLM engine, or a freshly loaded HF model."""
    config = config or BackendConfig()
    if config.backend == VLLM_SERVER:
        return VllmServerBackend.connect(config.model, config.engine.server_config(), config.dtype)
    if config.backend == "hf":
        from eviback.generation.hf import HFBackend

        return HFBackend.load(config.model, config.dtype, config.threads, config.hf_batch_size, device=config.device,
                              cache=config.hf_cache)
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("backend=vllm but vLLM is not installed in this environment: install it (on a GPU "
                           "machine the README's 'On a GPU' section; on a CPU the `vllm` extra), or generate with "
                           "transformers instead: --set backend=hf (train) / --backend hf (eval)")
    from eviback.generation.vllm import VllmConfig, get_vllm_backend

    return get_vllm_backend(VllmConfig(
        model=config.model,
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        kv_cache_gib=config.kv_cache_gib,
        executor=config.engine.executor,
        sleep_level=config.engine.sleep_level,
        **({"gpu_memory_utilization": config.engine.gpu_memory_utilization}
           if config.engine.gpu_memory_utilization is not None else {}),
        block_size=config.block_size,
        device=config.device,
        **({"threads": config.threads} if config.threads is not None else {}),
    ))


__all__ = ["BACKENDS", "VLLM_SERVER", "BackendConfig", "EngineSettings", "Completion", "FinishReason", "GenerationBackend", "SamplingConfig",
           "load_backend"]
