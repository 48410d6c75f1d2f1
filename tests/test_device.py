"""The placement rule (`eviback.device`): what each `device` setting resolves to, decided once with the dtype."""

from __future__ import annotations

import pytest
import torch

from eviback import device as devices


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(devices.ENV_VAR, raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    devices.reset()
    yield
    devices.reset()


@pytest.mark.parametrize(("setting", "cuda", "count", "rank", "expected"), [
    ("auto", False, 0, 0, "cpu"),
    ("auto", True, 1, 0, "cuda:0"),
    ("auto", True, 4, 2, "cuda:2"),  # accelerate launch: each process its own GPU
    ("auto", True, 1, 3, "cuda:0"),  # one visible GPU per process (CUDA_VISIBLE_DEVICES set by the launcher)
    ("cuda", True, 2, 1, "cuda:1"),
    ("cuda:1", True, 2, 0, "cuda:1"),
    ("cpu", True, 8, 0, "cpu"),
])
def test_resolve_device(setting, cuda, count, rank, expected):
    assert devices.resolve_device(setting, cuda_available=cuda, cuda_count=count, rank=rank)[0] == expected


@pytest.mark.parametrize(("setting", "cuda", "count", "message"), [
    ("cuda", False, 0, "no CUDA device"),
    ("cuda:2", True, 2, "only 2 CUDA device"),
    ("gpu", True, 1, "device must be auto, cpu, cuda or cuda:N"),
    ("cuda:x", True, 1, "device must be"),
])
def test_resolve_device_refuses(setting, cuda, count, message):
    with pytest.raises(ValueError, match=message):
        devices.resolve_device(setting, cuda_available=cuda, cuda_count=count, rank=0)


def test_environment_forces_auto(monkeypatch):
    monkeypatch.setenv(devices.ENV_VAR, "cpu")
    device, reason = devices.resolve_device("auto", cuda_available=True, cuda_count=1, rank=0)
    assert device == "cpu" and devices.ENV_VAR in reason
    assert devices.resolve_device("cuda:0", cuda_available=True, cuda_count=1, rank=0)[0] == "cuda:0"  # explicit wins
    monkeypatch.setenv(devices.ENV_VAR, "tpu")
    with pytest.raises(ValueError, match=devices.ENV_VAR):
        devices.resolve_device("auto", cuda_available=True, cuda_count=1, rank=0)


def test_local_rank_is_read_from_the_launcher(monkeypatch):
    assert devices.local_rank() == 0
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert devices.local_rank() == 3


def test_place_resolves_device_and_dtype_together():
    placement = devices.place("cpu", "float32")
    assert (placement.device, placement.dtype, placement.kind, placement.accelerator) == ("cpu", "float32", "cpu", False)
    assert placement.torch_device == torch.device("cpu") and placement.torch_dtype is torch.float32
    assert devices.place(placement) is placement  # a placement passes through
    assert devices.place(placement, "bfloat16").dtype == "bfloat16"
    record = placement.to_dict()
    assert record["device"] == "cpu" and record["dtype"] == "float32" and record["device_requested"] == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_place_refuses_a_gpu_that_is_not_there():
    with pytest.raises(ValueError, match="no CUDA device"):
        devices.place("cuda")


def test_record_notes_where_models_went():
    placement = devices.place("cpu", "float32")
    model = torch.nn.Linear(2, 2)
    assert devices.record("tiny", model, placement) is model
    devices.record("no placement", torch.nn.Linear(2, 2))
    assert devices.placements() == [{"what": "tiny", "device": "cpu", "placement": "cpu"},
                                    {"what": "no placement", "device": "cpu", "placement": None}]
    assert devices.off_device() == []
    away = [{"what": "judge", "device": "cpu", "placement": "cuda:0"}]
    assert devices.off_device(away) == away


def test_load_model_places_and_records_the_policy(tmp_path):
    """`load_model` puts the model where the placement says and records it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eviback.policy import load_model

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = load_model(str(tmp_path), "float32", device="cpu", what="policy engine")
    assert next(model.parameters()).device.type == "cpu" and not model.training
    assert devices.placements()[-1] == {"what": "policy engine", "device": "cpu", "placement": "cpu"}
