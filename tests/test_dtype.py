"""`dtype: auto`: bf16 where the device computes it natively, fp32 otherwise, decided from a cached
measurement; forced by a setting or $EVIBACK_DTYPE; recorded with its reason."""

from __future__ import annotations

import json

import pytest

from eviback import dtype as dtypes
from eviback.dtype import DtypeChoice, MatmulSpeed, decide

NATIVE = MatmulSpeed(bf16_gflops=194.5, fp32_gflops=82.0, size=384)  # measured with avx512_bf16
EMULATED = MatmulSpeed(bf16_gflops=2.2, fp32_gflops=92.3, size=384)  # the same CPU limited to AVX2 kernels
NO_GAIN = MatmulSpeed(bf16_gflops=90.0, fp32_gflops=80.0, size=384)  # converted on the fly: not worth it


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """Each test decides afresh, with its own cache and no forcing variable."""
    monkeypatch.setenv("EVIBACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(dtypes.ENV_VAR, raising=False)
    dtypes.reset()
    yield
    dtypes.reset()


def test_cpu_rule_follows_the_measured_speed():
    assert decide(cuda=False, speed=NATIVE)[0] == "bfloat16"
    assert decide(cuda=False, speed=EMULATED)[0] == "float32"
    assert decide(cuda=False, speed=NO_GAIN)[0] == "float32"  # 1.1x does not buy bf16's precision loss
    dtype, reason = decide(cuda=False, speed=EMULATED)
    assert "without native bf16" in reason and "2.2 GFLOP/s" in reason and "92.3 GFLOP/s" in reason


def test_cuda_rule_reads_bf16_support():
    assert decide(cuda=True, cuda_bf16=True) == ("bfloat16", "CUDA device with native bf16")
    assert decide(cuda=True, cuda_bf16=False)[0] == "float32"
    with pytest.raises(ValueError, match="measurement"):
        decide(cuda=False)


@pytest.mark.parametrize("speed, expected", [(NATIVE, "bfloat16"), (EMULATED, "float32")])
def test_auto_resolves_from_a_faked_capability(monkeypatch, speed, expected):
    monkeypatch.setattr(dtypes, "measure_matmul", lambda: speed)
    choice = dtypes.choose("auto", device="cpu")
    assert choice.dtype == expected
    assert choice.requested == "auto" and choice.speed == speed
    assert dtypes.resolve("auto", device="cpu") == expected


def test_explicit_and_forced_dtypes_win(monkeypatch):
    monkeypatch.setattr(dtypes, "measure_matmul", lambda: pytest.fail("an explicit dtype is never measured"))
    assert dtypes.choose("bfloat16", device="cpu") == DtypeChoice("bfloat16", "bfloat16", "set explicitly", "cpu")
    monkeypatch.setenv(dtypes.ENV_VAR, "float32")
    choice = dtypes.choose("auto", device="cpu")
    assert (choice.dtype, choice.reason) == ("float32", "$EVIBACK_DTYPE=float32")
    dtypes.reset()
    monkeypatch.setenv(dtypes.ENV_VAR, "fp8")
    with pytest.raises(ValueError, match=r"\$EVIBACK_DTYPE must be one of bfloat16, float32, float16"):
        dtypes.choose("auto", device="cpu")


def test_unknown_settings_name_the_choices():
    with pytest.raises(ValueError, match="dtype must be one of auto, bfloat16, float32, float16, got 'bf16'"):
        dtypes.choose("bf16")
    from eviback.train.config import TrainConfig

    with pytest.raises(ValueError, match="dtype must be one of auto, bfloat16, float32, got 'float16'"):
        TrainConfig(dtype="float16")
    assert TrainConfig().dtype == "auto"


def test_every_command_offers_the_one_list_of_dtypes():
    """A command that runs a model offers float16; one that trains refuses it, as its configuration does."""
    import argparse

    from eviback.cli import _load
    from eviback.train.judge_builder import EvidenceJudgeConfig
    from eviback.train.sft import WarmStartConfig

    def choices(command: str) -> tuple[str, ...]:
        parser = argparse.ArgumentParser()
        _load(command).add_arguments(parser)
        return tuple(next(a for a in parser._actions if "--dtype" in a.option_strings).choices)

    assert dtypes.CHOICES == ("auto", "bfloat16", "float32", "float16")
    assert dtypes.TRAINING_CHOICES == ("auto", "bfloat16", "float32")
    for command in ("eval", "judge", "ape"):
        assert choices(command) == dtypes.CHOICES, command
    for command, config in (("sft", WarmStartConfig), ("build_judge", EvidenceJudgeConfig)):
        assert choices(command) == dtypes.TRAINING_CHOICES, command
        with pytest.raises(ValueError, match=r"dtype.* must be one of auto, bfloat16, float32, got 'float16'"):
            config(dtype="float16")


def test_the_measurement_is_cached_per_isa_setting(monkeypatch, tmp_path):
    calls = []

    def measure():
        calls.append(1)
        return EMULATED

    monkeypatch.setattr(dtypes, "measure_matmul", measure)
    for name in dtypes.ISA_VARIABLES:  # whatever the machine running the tests restricts
        monkeypatch.delenv(name, raising=False)
    assert dtypes.cpu_speed() == EMULATED
    assert dtypes.cpu_speed() == EMULATED  # read back from the cache file
    assert len(calls) == 1
    [cached] = (tmp_path / "cache" / "dtype").glob("matmul-*.json")
    assert json.loads(cached.read_text())["bf16_gflops"] == 2.2
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # other kernels: measured again
    dtypes.cpu_speed()
    assert len(calls) == 2
    cached.write_text("not json")  # a damaged file is measured again, not an error
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert dtypes.cpu_speed() == EMULATED and len(calls) == 3


def test_a_real_measurement_gives_positive_speeds():
    """The micro-benchmark itself (not its verdict, which depends on the machine)."""
    speed = dtypes.measure_matmul(size=64, seconds=0.01)
    assert speed.bf16_gflops > 0 and speed.fp32_gflops > 0 and speed.size == 64
    record = dtypes.choose("auto", device="cpu").to_dict()
    assert record["dtype"] in ("bfloat16", "float32") and record["reason"]
    json.dumps(record)  # what runs write into their directories


def test_the_choice_is_logged_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(dtypes, "measure_matmul", lambda: NATIVE)
    with caplog.at_level("INFO", logger="eviback.dtype"):
        for _ in range(3):
            dtypes.choose("auto", device="cpu")
    assert sum("dtype auto -> bfloat16" in r.getMessage() for r in caplog.records) == 1


def test_the_demo_does_less_work_where_auto_falls_back_to_fp32():
    """`eviback demo` on a CPU without native bf16: fewer steps and held-out questions, said plainly, the
    preset's warm start kept (its precondition is the one measured); a setting the user gave, an explicit dtype,
    native bf16 and CUDA leave the preset as it is."""
    from eviback.commands.demo import NO_NATIVE_BF16, size_for_this_machine
    from eviback.train.config import resolve_config

    preset = resolve_config("demo", None, [])
    slow = DtypeChoice("auto", "float32", "CPU without native bf16: ...", "cpu", EMULATED)
    sized, message = size_for_this_machine(preset, slow, set())
    assert sized.max_steps == NO_NATIVE_BF16["max_steps"] < preset.max_steps
    assert sized.eval_limit == NO_NATIVE_BF16["eval_limit"] < preset.eval_limit
    assert sized.warm_start_examples == preset.warm_start_examples
    assert "float32" in message and f"max_steps {preset.max_steps} -> {NO_NATIVE_BF16['max_steps']}" in message
    assert "--full" in message
    kept, message = size_for_this_machine(preset, slow, {"max_steps"})
    assert kept.max_steps == preset.max_steps and message
    assert kept.eval_limit == NO_NATIVE_BF16["eval_limit"]
    native = DtypeChoice("auto", "bfloat16", "CPU with native bf16", "cpu", NATIVE)
    assert size_for_this_machine(preset, native, set()) == (preset, None)
    assert size_for_this_machine(preset, DtypeChoice("auto", "float32", "no bf16", "cuda"), set()) == (preset, None)
    forced = resolve_config("demo", None, ["dtype=float32"])
    assert size_for_this_machine(forced, DtypeChoice("float32", "float32", "set explicitly", "cpu"), set()) \
        == (forced, None)
