"""No import cycle among the project's own modules (issue 14).

A cycle makes import order matter (a half-initialised module on one side), forces lazy
function-level imports, and ties layers together that should depend one way only. The graph
is built from the source, not by importing it: every ``import megatron.x`` / ``from megatron.x
import y`` at any nesting level counts (a lazy import inside a function is still a
dependency), except under ``if TYPE_CHECKING:``, which never runs. ``from pkg import name``
where ``pkg.name`` is a module counts as importing that module.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

def project_modules() -> dict[str, Path]:
    """Dotted name -> file of every module under ``megatron/`` (a namespace package)."""
    modules = {}
    for path in sorted((ROOT / "megatron").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, type_checking: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, skipping ``if TYPE_CHECKING:`` bodies unless
    ``type_checking`` (a type-only import still ties the modules' designs together)."""
    for child in ast.iter_child_nodes(node):
        if not type_checking and isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _imports(other)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _imports(child, type_checking)


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def dependencies(module: str, path: Path, modules: dict[str, Path], type_checking: bool = False) -> set[str]:
    """The project modules ``module`` imports (``type_checking``: under ``if TYPE_CHECKING:`` too)."""
    found = set()
    for node in _imports(ast.parse(path.read_text(), str(path)), type_checking):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                package = _package_of(module, path).split(".")
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, *([base] if base else [])])
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        for target in targets:
            # ``import a.b.c`` also runs a and a.b; the nearest project module stands for it
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: dependencies(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative): components of more than one module, or self-loops."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return components


def test_the_scan_finds_a_cycle():
    """The detector itself: a three-module ring and a pair are found, a chain is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert sorted(strongly_connected(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_relative_and_submodule_imports_are_edges(tmp_path):
    """``from pkg import sub`` imports the submodule; TYPE_CHECKING imports do not count."""
    pkg = tmp_path / "megatron" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub.py").write_text("")
    (pkg / "other.py").write_text("")
    mod = pkg / "mod.py"
    mod.write_text("from typing import TYPE_CHECKING\nfrom . import sub\n"
                   "if TYPE_CHECKING:\n    from megatron.pkg import other\n")
    modules = {"megatron.pkg": pkg / "__init__.py", "megatron.pkg.sub": pkg / "sub.py",
               "megatron.pkg.other": pkg / "other.py", "megatron.pkg.mod": mod}
    assert dependencies("megatron.pkg.mod", mod, modules) == {"megatron.pkg", "megatron.pkg.sub"}


def test_no_import_cycle():
    cycles = strongly_connected(import_graph())
    assert not cycles, "import cycles among project modules:\n" + "\n".join(
        "  " + " <-> ".join(c) for c in cycles)
