"""The `eviback` command line, run as a user runs it."""

import json
import subprocess
import sys


def eviback(*args, check=True):
    return subprocess.run([sys.executable, "-m", "eviback.cli", *args], capture_output=True, text=True, check=check)


def test_help_lists_commands():
    out = eviback("--help").stdout
    assert "data" in out and "validate and convert" in out


def test_every_command_has_help():
    out = eviback("--help").stdout
    commands = [c for c in ("demo", "train", "sft", "eval", "report", "judge", "build-judge", "ape", "index",
                            "serve", "data") if c in out]
    assert "build-judge" in commands
    for command in commands:
        result = eviback(command, "--help", check=False)
        assert result.returncode == 0 and "Traceback" not in result.stderr, (command, result.stderr[-500:])


def test_data_validate_reports_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "question": "q", "golden_answers": ["a"]}\n{"id": "2", "question": "q"}\n')
    result = eviback("data", "validate", str(bad), check=False)
    assert result.returncode == 2
    assert f"{bad}:2: missing field 'golden_answers'" in result.stderr
    assert "Traceback" not in result.stderr
    result = eviback("data", "validate", str(bad), "--skip-bad", check=False)
    assert result.returncode == 1
    assert "1 records ok, 1 skipped" in result.stdout


def test_data_validate_warns_about_golds_that_normalise_to_nothing(tmp_path, capsys):
    from eviback.cli import main

    path = tmp_path / "q.jsonl"
    path.write_text('{"id": "a", "question": "q?", "golden_answers": ["x"]}\n'
                    '{"id": "b", "question": "symbol?", "golden_answers": ["saltire", "*"]}\n')
    assert main(["data", "validate", str(path)]) == 0  # the file is valid: warned, not refused
    out = capsys.readouterr().out
    assert f"warning: {path}:2: question 'b': gold answer '*'" in out
    assert "2 records ok, 0 skipped, 1 warning(s)" in out


def test_data_convert_to_parquet_and_back(tmp_path):
    src = tmp_path / "q.jsonl"
    src.write_text(json.dumps({"id": "1", "question": "who?", "golden_answers": ["a"]}) + "\n")
    eviback("data", "convert", str(src), str(tmp_path / "q.parquet"))
    eviback("data", "convert", str(tmp_path / "q.parquet"), str(tmp_path / "back.jsonl"))
    assert json.loads((tmp_path / "back.jsonl").read_text())["golden_answers"] == ["a"]


def test_data_suite_lists_embedded_benchmarks():
    out = eviback("data", "suite").stdout
    for name in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"):
        assert f"eval:   {name}" in out
