"""No modules import each other in a circle: neither ipcsync's modules nor scripts/'s.

Every import statement counts, wherever it stands: at module level, under
``if TYPE_CHECKING:`` (a circle of type-only imports is still a circle in what the modules
need to be understood) and inside functions (a lazy import defers a circle, it does not
remove it). Relative imports are resolved against their package; ``from pkg import name``
is an edge to ``pkg.name`` where that is a module (a ``.py`` file, a package, or a compiled
module's ``.pyi`` stub), else to ``pkg``. A submodule's implicit import of its parent
package is not an edge. The modules of scripts/ import each other by bare name (scripts/
is on their path). Checked on the source, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules(root: Path, package: bool) -> dict[str, Path | None]:
    """Module name -> its file (None for a compiled module known by its stub)."""
    base = root.parent if package else root
    found: dict[str, Path | None] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    for stub in sorted(root.rglob("*.pyi")):
        found.setdefault(".".join(stub.relative_to(base).with_suffix("").parts), None)
    return found


def import_graph(root: Path, package: bool) -> dict[str, set[str]]:
    """Which of the tree's modules each module imports (see the module docstring)."""
    modules = _modules(root, package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        out: set[str] = set()
        if path is not None:
            is_package = path.name == "__init__.py"
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    out.update(a.name for a in node.names if a.name in modules)
                elif isinstance(node, ast.ImportFrom):
                    if node.level:
                        parts = name.split(".") if is_package else name.split(".")[:-1]
                        parts = parts[: len(parts) - (node.level - 1)]
                        source = ".".join(parts + ([node.module] if node.module else []))
                    else:
                        source = node.module or ""
                    for alias in node.names:
                        target = f"{source}.{alias.name}"
                        if target in modules:
                            out.add(target)
                        elif source in modules:
                            out.add(source)
        out.discard(name)
        graph[name] = out
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each group of modules that reach each other through their imports (Tarjan's
    strongly connected components of more than one module), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


def circle(graph: dict[str, set[str]], group: list[str]) -> list[str]:
    """A shortest circle through the group's first module, inside the group:
    ``[a, b, ..., a]``."""
    start, members = group[0], set(group)
    came_from: dict[str, str] = {}
    todo = [start]
    while todo:
        nxt = []
        for v in todo:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        todo = nxt
    raise AssertionError(f"no circle through {start} in {sorted(group)}")


def _say(graph: dict[str, set[str]], found: list[list[str]]) -> str:
    return "modules that import each other in a circle:\n" + "\n".join(
        f"{' -> '.join(circle(graph, g))} (the circle's modules: {', '.join(g)})" for g in found)


def test_no_ipcsync_modules_import_each_other_in_a_circle() -> None:
    graph = import_graph(ROOT / "ipcsync", package=True)
    assert "ipcsync.runtime.producer.port" in graph and "ipcsync.runtime.aio" in graph["ipcsync.runtime.producer.port"]
    found = cycles(graph)
    assert not found, _say(graph, found)


def test_no_scripts_import_each_other_in_a_circle() -> None:
    graph = import_graph(ROOT / "scripts", package=False)
    assert "benchprocs" in graph["bench"]
    found = cycles(graph)
    assert not found, _say(graph, found)


def test_the_check_sees_type_only_and_lazy_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.b import B\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import C\n")
    (pkg / "c.py").write_text("from . import a\nfrom .sub import b as _b\nfrom . import _compiled\n")
    (pkg / "_compiled.pyi").write_text("")
    (pkg / "d.py").write_text("import pkg.c\n")
    graph = import_graph(pkg, package=True)
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a", "pkg.sub.b", "pkg._compiled"}
    assert graph["pkg.d"] == {"pkg.c"}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert circle(graph, ["pkg.a", "pkg.c", "pkg.sub.b"]) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    flat = tmp_path / "scripts"
    flat.mkdir()
    (flat / "x.py").write_text("import y\n")
    (flat / "y.py").write_text("def g():\n    from x import h\n")
    assert cycles(import_graph(flat, package=False)) == [["x", "y"]]
