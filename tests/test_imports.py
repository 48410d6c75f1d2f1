"""The import graph of eviback has no cycle, and no module imports a layer above its own.

Every import in every module of src/eviback counts: at the top, inside functions, and inside
`if TYPE_CHECKING:` blocks (a cycle hidden from the interpreter is still a knot for a reader). An edge goes
to the module named: `from eviback.ape.gates import X` is an edge to `eviback.ape.gates`, `from eviback.ape
import spec` to `eviback.ape.spec`, `from eviback.ape import run_ape` to the package's `__init__`. The
package's `__init__` running before any of its submodules (Python's import machinery) is not an edge.
"""

import ast
from pathlib import Path

import eviback

PACKAGE = "eviback"
ROOT = Path(eviback.__file__).parent

# The layers, lowest first: a module may import its own layer and those below, never one above. (The data,
# protocol and records at the bottom; the engines, retrieval and the teacher in the middle; training, E2E-APE,
# experiments and the command line on top.)
LAYERS = (
    {"types", "metrics", "protocol", "data", "queries", "cache", "settings", "dtype", "device", "templates", "log_format", "stats",
     "unavailable", "vllm_process", "disk"},
    {"policy", "retrieval", "generation", "backoff"},
    {"rollout", "teacher", "evaluate", "viewer", "prepare"},
    {"train", "ape"},
    {"experiment"},
    {"commands", "cli"},
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PACKAGE, *parts])


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for rank, names in enumerate(LAYERS):
        if top in names:
            return rank
    raise AssertionError(f"{module}: its top-level name {top!r} is in no layer of tests/test_imports.py")


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of the package that `path` imports."""
    here = _module_name(path)
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package of `here`
                parent = here if path.name == "__init__.py" else here.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    parent = parent.rsplit(".", 1)[0]
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    out.add(f"{base}.{alias.name}")
                elif base in modules:
                    out.add(base)
    out.discard(here)
    return out


def import_graph() -> dict[str, set[str]]:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_every_module():
    graph = import_graph()
    assert "eviback.ape.gates" in graph["eviback.ape.measure"] | graph["eviback.ape.confirm"] | graph[
        "eviback.ape.evaluate"]
    assert "eviback.teacher.evidence_judge" in graph["eviback.train.judge_builder"]
    assert len(graph) == len(list(ROOT.rglob("*.py")))


def test_no_import_cycle():
    found = cycles(import_graph())
    assert found == [], "import cycles in eviback: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_module_imports_a_layer_above_its_own():
    upward = sorted(f"{a} -> {b}" for a, targets in import_graph().items() for b in targets
                    if "." in a and "." in b and _layer(b) > _layer(a))
    assert upward == [], "imports of a higher layer: " + "; ".join(upward)
