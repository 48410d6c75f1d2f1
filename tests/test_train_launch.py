"""A launch that shards the parameters (FSDP, DeepSpeed ZeRO-3) is refused before any work: eviback refreshes
its generation engine from the trainer's parameters, which would be slices (eviback.train.launch)."""

from __future__ import annotations

import json

import pytest

from eviback.train.launch import check_launch, parameter_sharding


@pytest.mark.parametrize(("environ", "sharding"), [
    ({}, None),
    ({"ACCELERATE_USE_FSDP": "true"}, "FSDP"),
    ({"ACCELERATE_USE_FSDP": "false"}, None),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, "DeepSpeed ZeRO-3"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}, None),
    ({"ACCELERATE_USE_DEEPSPEED": "false", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, None),
])
def test_what_accelerate_launch_passes_says_whether_the_parameters_are_sharded(environ, sharding):
    assert parameter_sharding(environ) == sharding


def test_a_deepspeed_config_file_is_read_for_its_stage(tmp_path):
    path = tmp_path / "ds.json"
    environ = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(path)}
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert parameter_sharding(environ) == "DeepSpeed ZeRO-3"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert parameter_sharding(environ) is None
    path.write_text("not json")
    assert parameter_sharding(environ) is None  # DeepSpeed says what is wrong with its own file
    with pytest.raises(ValueError, match="launched with FSDP.*--zero_stage 2"):
        check_launch({"ACCELERATE_USE_FSDP": "1"})


def test_eviback_train_refuses_a_sharded_launch_before_any_work(tmp_path, capsys, monkeypatch):
    from eviback.cli import main

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    output = tmp_path / "run"
    code = main(["train", "--preset", "demo", "--output", str(output)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "launched with DeepSpeed ZeRO-3" in err and "--use_deepspeed --zero_stage 2" in err
    assert not output.exists()
