"""Fixtures shared across test modules.

`vllm_backend` is the one vLLM engine of the test session: starting one takes about a minute, so every
test that needs vLLM generation should take it from here (the engine factory also returns this same
engine to any code under test that asks for `BackendConfig(kv_cache_gib=0.75)`, e.g. `eviback eval
--kv-cache-gib 0.75` run in-process). Its KV cache is kept small (0.75 GiB, a fraction of a GiB as the
training runs plan it) for a shared CI machine."""

from __future__ import annotations

import tempfile

import pytest

# bound here, once: a test that monkeypatches eviback.disk does not change what the suite's own sampling reads
from eviback.disk import free_bytes, gigabytes

# The suite's own files at their peak (the venv aside): 4.6 GB at the lowest free space sampled after a test's
# body in a clean clone of 08ad5f1, and more for a moment inside the experiment test, hence "about 6 GB"; most
# of it the end-to-end training tests' checkpoints (1.9 GB each for the 135M policy), removed as each passes.
SUITE_PEAK_GB = 6

# The free disk space under the temporary directory: at the start, and the lowest seen at the end of a test's
# body (before its tmp_path goes). A disk that fills mid-suite fails the training tests with I/O errors from
# safetensors or torch that name no cause a reader would look for; the summary's last line names it.
_free: dict[str, int] = {}


def _sample_free_space() -> None:
    free = free_bytes(tempfile.gettempdir())
    _free.setdefault("start", free)
    _free["lowest"] = min(free, _free.get("lowest", free))


def pytest_sessionstart(session: pytest.Session) -> None:
    _sample_free_space()


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> None:
    if call.when == "call":
        _sample_free_space()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if "start" not in _free:
        return
    line = (f"disk under {tempfile.gettempdir()}: {gigabytes(_free['start'])} free at the start, "
            f"{gigabytes(_free['lowest'])} at the lowest (the suite writes about {SUITE_PEAK_GB} GB at its peak)")
    if _free["lowest"] < 10**9:
        line += "; the disk filled: failures with 'No space left on device' are that, not the code"
    terminalreporter.write_line(line)

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
