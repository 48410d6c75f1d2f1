"""A rule of the GPU path, a cheap second net beside tests/test_device_discipline.py: every tensor a module of
train/ or generation/ makes with a factory (`torch.zeros`, `torch.tensor`, `torch.arange`, ...) names its
device, so that whoever reads the line sees where the tensor lives (a factory without one makes a CPU tensor,
wherever the tensors it meets are). The `*_like` and `Tensor.new_*` factories take their device from a tensor
and need none. A call that cannot name one is listed in EXCEPTIONS with the reason."""

from __future__ import annotations

import ast
from pathlib import Path

import eviback

SRC = Path(eviback.__file__).parent
PACKAGES = ("train", "generation")
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
             "linspace", "eye", "Generator"}
# "module.py:function": why the factory there names no device
EXCEPTIONS: dict[str, str] = {}


def factory_calls() -> list[str]:
    """Every `torch.<factory>(...)` without a `device=` keyword in the packages, as `path:function:line`."""
    found = []
    for package in PACKAGES:
        for path in sorted((SRC / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            functions = {}
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for inner in ast.walk(node):
                        functions.setdefault(id(inner), node.name)
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                        and node.func.attr in FACTORIES):
                    continue
                if any(k.arg == "device" for k in node.keywords):
                    continue
                found.append(f"{path.relative_to(SRC)}:{functions.get(id(node), '<module>')}:{node.lineno}")
    return found


def test_every_tensor_factory_names_its_device():
    unnamed = [c for c in factory_calls() if c.rsplit(":", 1)[0] not in EXCEPTIONS]
    assert not unnamed, "tensor factories without device= (name it, or list the call in EXCEPTIONS with why):\n  " \
        + "\n  ".join(unnamed)


def test_the_exceptions_are_still_there():
    listed = {c.rsplit(":", 1)[0] for c in factory_calls()}
    assert not set(EXCEPTIONS) - listed, f"no longer needed: {sorted(set(EXCEPTIONS) - listed)}"
