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


def test_data_validate_names_the_line_that_is_not_utf8_and_skips_it_on_request(tmp_path):
    import gzip

    text = b'{"id": "1", "question": "q?", "golden_answers": ["x"]}\n{"id": "2", "question": "caf\xe9?", ' \
           b'"golden_answers": ["y"]}\n{"id": "3", "question": "r?", "golden_answers": ["z"]}\n'
    for path in (tmp_path / "latin1.jsonl", tmp_path / "latin1.jsonl.gz"):
        path.write_bytes(gzip.compress(text) if path.suffix == ".gz" else text)
        result = eviback("data", "validate", str(path), check=False)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert f"{path}:2: not UTF-8 text: byte 0xe9 at column 29" in result.stderr
        result = eviback("data", "validate", str(path), "--skip-bad", check=False)
        assert result.returncode == 1 and "2 records ok, 1 skipped" in result.stdout  # the line after it is read


def test_a_reader_that_stops_early_ends_the_command_quietly():
    # `eviback data suite | head -1`: the reader is gone before the command writes
    child = subprocess.Popen([sys.executable, "-m", "eviback.cli", "data", "suite"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    child.stdout.close()
    err = child.stderr.read().decode()
    assert child.wait(timeout=60) == 141 and err == ""
