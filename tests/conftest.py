"""Fixtures shared across test modules.

`vllm_backend` is the one vLLM engine of the test session: starting one takes about a minute, so every
test that needs vLLM generation should take it from here (the engine factory also returns this same
engine to any code under test that asks for `BackendConfig(kv_cache_gib=0.75)`, e.g. `eviback eval
--kv-cache-gib 0.75` run in-process). Its KV cache is kept small (0.75 GiB, a fraction of a GiB as the
training runs plan it) for a shared CI machine."""

from __future__ import annotations

import pytest

# The configuration of the session's engine; code under test that asks for the same gets the same engine.
TEST_KV_CACHE_GIB = 0.75


@pytest.fixture(scope="session")
def vllm_kv_cache_gib() -> float:
    """The KV cache of the session's engine: pass it to code under test so that it reuses that engine."""
    return TEST_KV_CACHE_GIB


@pytest.fixture(scope="session")
def vllm_backend():
    pytest.importorskip("vllm")
    from eviback.generation import BackendConfig, load_backend

    return load_backend(BackendConfig(backend="vllm", kv_cache_gib=TEST_KV_CACHE_GIB))


@pytest.fixture(scope="session")
def hf_backend():
    from eviback.generation.hf import HFBackend

    # One thread while generating: on a shared 2-core machine two OpenMP threads stall each other.
    return HFBackend.load("smollm2-135m", threads=1)  # dtype auto: bf16 where native, fp32 elsewhere
