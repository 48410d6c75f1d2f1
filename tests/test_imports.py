"""The import graph of `eviback.ape` has no cycle.

Every import in every module of src/eviback/ape counts: at the top, inside functions, and inside
`if TYPE_CHECKING:` blocks (a cycle hidden from the interpreter is still a knot for a reader). An edge goes
to the module named: `from eviback.ape.gates import X` is an edge to `eviback.ape.gates`, `from eviback.ape
import spec` to `eviback.ape.spec`, `from eviback.ape import run_ape` to the package's `__init__`. The
package's `__init__` running before any of its submodules (Python's import machinery) is not an edge.
"""

import ast
from pathlib import Path

import eviback.ape

PACKAGE = "eviback.ape"
ROOT = Path(eviback.ape.__file__).parent


def _module_name(path: Path) -> str:
    return PACKAGE if path.name == "__init__.py" else f"{PACKAGE}.{path.stem}"


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
    paths = sorted(ROOT.glob("*.py"))
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
    assert len(graph) == len(list(ROOT.glob("*.py")))


def test_no_import_cycle_in_ape():
    found = cycles(import_graph())
    assert found == [], "import cycles in eviback.ape: " + "; ".join(" <-> ".join(c) for c in found)
