"""Run Python on an AVX-512 machine as on an AVX2-only one (benchmarks only; never imported by eviback).

`benchmarks/avx2_only/run CMD...` puts this folder on PYTHONPATH and sets `ATEN_CPU_CAPABILITY=avx2` (PyTorch's
own kernels) and `ONEDNN_MAX_CPU_ISA=AVX2` (oneDNN's matmuls and convolutions, PyTorch's and vLLM's copies).
Those two do not reach vLLM's CPU build, which picks its kernel library (`_C` with AVX512-BF16, `_C_AVX512`
or `_C_AVX2`) from `torch.cpu._is_avx512_supported()` / `_is_avx512_bf16_supported()`, and those read the
CPU's flags directly. So, at interpreter start-up (every process, children included), this file makes the
capability probes of `torch.cpu` answer as an AVX2-only CPU would.

Checked on the machine it was written on (AMD EPYC with avx512_bf16): one-thread bf16 matmul fell from 201 to
2.3 GFLOP/s (512^3) while fp32 stayed at 79-85, the 60x gap reported from a real AVX2-only laptop; vLLM loads
`_C_AVX2` (results/precision.md).

PyTorch's compiler (inductor, which vLLM's CPU sampler and model use) needs two more things, set here unless
the caller set them:

- its own kernel cache, `TORCHINDUCTOR_CACHE_DIR`: inductor picks its vector width from
  `ATEN_CPU_CAPABILITY` but does not key its cache on it, so a kernel compiled by a native run on the same
  machine was reused by a restricted one, and the reverse. Measured with vLLM's CPU sampler (softmax,
  exponential noise, argmax, compiled): after a native run, the restricted one sampled tokens of probability
  3e-4 where one token held 0.998 (every rollout garbage, the rollouts of a group alike); after a restricted
  run, the native one aborted ("munmap_chunk(): invalid pointer"). Each ISA in a cache of its own, both
  sample right.
- `TORCHINDUCTOR_CPP_MARCH=haswell`: inductor compiles with `-march=native`, which here would let the compiler
  use AVX-512 instructions that an AVX2-only CPU lacks.
"""

import os

if os.environ.get("EVIBACK_AVX2_ONLY") == "1":
    _user = os.environ.get("USER") or str(os.getuid())
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          os.path.join(os.environ.get("TMPDIR", "/tmp"), f"torchinductor_{_user}_avx2_only"))
    os.environ.setdefault("TORCHINDUCTOR_CPP_MARCH", "haswell")
    try:
        import torch.cpu
    except ImportError:  # a Python without torch (the venv being made, pip before torch): nothing to restrict
        torch = None
    for _probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                   "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        if torch is not None and hasattr(torch.cpu, _probe):
            setattr(torch.cpu, _probe, lambda: False)
