"""Settings are type-checked where they are read: `--set key=value`, YAML files, experiment settings."""

import sys
import types

import pytest

from eviback.settings import check_setting, parse_setting_value, type_name
from eviback.train.config import TrainConfig, resolve_config


@pytest.mark.parametrize(("name", "text", "tp", "expected"), [
    ("lam", "0.5", float, 0.5),
    ("lam", "1", float, 1.0),  # an integer where a float is expected
    ("learning_rate", "1e-6", float, 1e-6),  # YAML 1.1 reads this as a string
    ("max_steps", "10", int, 10),
    ("warm_start", "false", bool, False),
    ("teacher", "on", str, "on"),  # a name, not YAML's True
    ("model", "1.10", str, "1.10"),  # the text as written, not the number 1.1
    ("data", "", str | None, None),
    ("data", "null", str | None, None),
    ("threads", "4", int | None, 4),
    ("eval_benchmarks", "[nq, popqa]", list[str], ["nq", "popqa"]),
    ("eval_benchmarks", "nq", list[str], ["nq"]),  # one value is a list of one
    ("eval_benchmarks", "[]", list[str], []),
])
def test_a_setting_is_parsed_as_its_type(name, text, tp, expected):
    value = parse_setting_value(name, text, tp)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize(("name", "text", "tp", "message"), [
    ("lam", "abc", float, r"--set lam=abc: setting 'lam' takes a number \(float\), got 'abc'"),
    ("lam", "true", float, r"setting 'lam' takes a number \(float\), got True"),
    ("lam", "", float, r"setting 'lam' takes a number \(float\), got nothing"),
    ("max_steps", "2.5", int, r"setting 'max_steps' takes an integer \(int\), got 2.5"),
    ("warm_start", "1", bool, r"setting 'warm_start' takes true or false \(bool\), got 1"),
    ("teacher", "", str, r"setting 'teacher' takes a string \(str\), got nothing"),
    ("threads", "many", int | None, r"setting 'threads' takes an integer or null \(int \| None\), got 'many'"),
    ("eval_benchmarks", "{nq: 1}", list[str], r"takes a list of strings \(list\[str\]\), got \{'nq': 1\}"),
    ("eval_benchmarks", "[nq", list[str], r"--set eval_benchmarks=\[nq: not a valid value for setting "
                                          r"'eval_benchmarks', which takes a list of strings"),
])
def test_a_setting_of_the_wrong_type_is_refused_by_name_and_type(name, text, tp, message):
    with pytest.raises(ValueError, match=message):
        parse_setting_value(name, text, tp)


def test_type_names():
    assert type_name(float) == "a number (float)"
    assert type_name(str | None) == "a string or null (str | None)"
    assert type_name(list[str]) == "a list of strings (list[str])"
    assert check_setting("report_to", ("a", "b"), list[str]) == ["a", "b"]


def test_train_overrides_are_typed():
    config = resolve_config("eviback", None, ["lam=1", "learning_rate=1e-6", "eval_benchmarks=nq"])
    assert config.backoff.lam == 1.0 and isinstance(config.backoff.lam, float)
    assert config.learning_rate == 1e-6 and config.eval_benchmarks == ["nq"]
    with pytest.raises(ValueError, match=r"--set lam=abc: setting 'lam' takes a number \(float\)"):
        resolve_config("eviback", None, ["lam=abc"])


def test_a_config_file_value_of_the_wrong_type_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lam: abc\n")
    with pytest.raises(ValueError, match=rf"{path}: setting 'lam' takes a number \(float\), got 'abc'"):
        resolve_config("eviback", path)
    path.write_text("learning_rate: 1e-6\nmax_steps: 3\n")  # YAML's string "1e-6" is a number here
    assert resolve_config("eviback", path).learning_rate == 1e-6


def test_a_config_built_any_way_is_typed():
    with pytest.raises(ValueError, match=r"setting 'lam' takes a number \(float\), got 'abc'"):
        TrainConfig.from_settings(lam="abc")
    with pytest.raises(ValueError, match=r"setting 'group_size' takes an integer \(int\), got '5'"):
        TrainConfig.from_settings(group_size="5")


def test_an_experiment_setting_of_the_wrong_type_names_the_arm_and_setting():
    from eviback.experiment.config import parse_experiment

    spec = {"name": "x", "out": "out", "steps": 1, "eval": {"benchmarks": ["nq"]},
            "arms": [{"name": "grpo", "preset": "grpo", "settings": {"lam": "abc"}}]}
    with pytest.raises(ValueError, match=r"arm 'grpo': setting 'lam' takes a number \(float\), got 'abc'"):
        parse_experiment(spec)


def test_sft_overrides_are_typed():
    from eviback.cli import build_parser
    from eviback.commands.sft import config_from_args

    # the command's own parser, so that the test sees every option it adds (the prompt's included)
    args = build_parser("sft").parse_args(["sft", "--max-examples", "10", "--dtype", "float32", "--no-progress",
                                           "--set", "warmup_ratio=0.1"])
    assert config_from_args(args).warmup_ratio == 0.1
    args.set = ["warmup_ratio=lots"]
    with pytest.raises(ValueError, match=r"--set warmup_ratio=lots: setting 'warmup_ratio' takes a number"):
        config_from_args(args)


@pytest.fixture
def no_training(monkeypatch):
    """Any training a command would start fails the test (and costs nothing): the runner is a stub."""
    def refuse(*args, **kwargs):
        raise AssertionError("a bad setting must stop the command before it trains")

    monkeypatch.setitem(sys.modules, "eviback.train.runner",
                        types.SimpleNamespace(run_training=refuse, teacher_is_oracle=refuse))


@pytest.mark.parametrize(("argv", "message"), [
    (["train", "--set", "lam=abc"], "eviback train: error: --set lam=abc: setting 'lam' takes a number (float), "
                                    "got 'abc'"),
    (["train", "--preset", "grpo", "--set", "max_steps=ten"], "setting 'max_steps' takes an integer (int)"),
    (["train", "--set", "eval_benchmarks=[nq"], "not a valid value for setting 'eval_benchmarks'"),
    (["demo", "--set", "warm_start=maybe"], "eviback demo: error: --set warm_start=maybe: setting 'warm_start' "
                                            "takes true or false (bool)"),
])
def test_cli_refuses_a_bad_setting_without_a_traceback(no_training, tmp_path, capsys, argv, message):
    from eviback.cli import main

    assert main([*argv, "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_cli_sft_refuses_a_bad_setting_without_a_traceback(capsys):
    from eviback.cli import main

    assert main(["sft", "--set", "epochs=x", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "eviback sft: error: --set epochs=x: setting 'epochs' takes a number (float), got 'x'" in err
    assert "Traceback" not in err
