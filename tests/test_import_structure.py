"""The package's import structure: no cycles between ``core`` modules or between its subpackages
(deferred imports inside functions count), data parallelism does not depend on the optimizer
(``core.optimizer`` builds on ``core.distributed``, never the reverse), and the transformer
building blocks do not depend on the models (``core.models`` builds on ``core.transformer``)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "core").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The ``core`` modules a file imports, anywhere in it (a deferred import is still a
    dependency; a ``TYPE_CHECKING`` import too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("core"):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                out.add(name if name in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("core"))
    return {m for m in out if m in modules}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_between_core_modules():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert sum(map(len, graph.values())) > 100  # the parse found the package's imports
    assert _cycles(graph) == []


def test_no_import_cycle_between_core_subpackages():
    modules = _modules()
    package = lambda name: ".".join(name.split(".")[:2])  # core.distributed.x -> core.distributed
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph.setdefault(package(name), set()).update(package(m) for m in _imports(path, modules))
    graph = {p: deps - {p} for p, deps in graph.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_data_parallelism_does_not_import_the_optimizer():
    check = "import sys, core.distributed; print(sorted(m for m in sys.modules if m.startswith('core.optimizer')))"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_transformer_blocks_do_not_import_the_models():
    check = ("import importlib, pkgutil, sys, core.transformer\n"
             "for m in pkgutil.walk_packages(core.transformer.__path__, 'core.transformer.'):\n"
             "    importlib.import_module(m.name)\n"
             "print(sorted(m for m in sys.modules if m.startswith('core.models')))")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
