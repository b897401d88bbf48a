"""The static import graph of ``megatron/``: no module cycle, and every import runs downward.

Read from the source with ``ast`` (imports inside functions and under ``TYPE_CHECKING``
included: a type-only import still means the lower layer has to know the upper one), so the
test fails on the commit that adds an upward arrow, not when the arrow first causes a
circular-import error at run time.

The floors, lowest first (docs/design.md, "Layers"):

* ``megatron/pipeline/`` is pure Python: it imports neither its runtime nor the trainer;
  ``megatron/pipeline/runtime/`` (torch) does not import the trainer;
* inside ``megatron/trainer``: the process environment and optional-package set-up, then
  config -> {tokenizer, data, models, optim} -> checkpointing -> tasks -> plan -> launch
  (processes only) -> loop; ``hf`` and ``generation`` (tools' code) sit on top. Packages on
  one floor may import each other, as long as no cycle forms.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "megatron"

#: floor of each ``megatron.trainer`` sub-package or top-level module
TRAINER_FLOORS: dict[str, int] = {
    "environment": 0, "optional_packages": 0,
    "config": 1,
    "tokenizer": 2, "data": 2, "models": 2, "optim": 2,
    "checkpointing": 3,
    "tasks": 4,
    "plan": 5,
    "launch": 6,
    "loop": 7,
    "hf": 8, "generation": 8,
}


def module_files() -> dict[str, pathlib.Path]:
    """Every module of ``megatron/`` by dotted name (a package by its ``__init__``)."""
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def imported_names(module: str, path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, dotted target) of every import statement of the file, relative ones resolved;
    ``from a import b`` yields both ``a`` and ``a.b`` (``b`` may be a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def import_graph(mods: dict[str, pathlib.Path] | None = None) -> dict[str, dict[str, int]]:
    """module -> {imported megatron module: first line}; a package's own ``__init__`` imported by
    its submodules (Python runs it first anyway) is not an arrow."""
    mods = module_files() if mods is None else mods

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for module, path in mods.items():
        for line, name in imported_names(module, path):
            target = resolve(name)
            if target is None or target == module or module.startswith(target + "."):
                continue
            graph[module].setdefault(target, line)
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components with more than one module (iterative: the graph is deep)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
                    found.append(sorted(component))
    return found


def floor_of(module: str) -> tuple[str, int] | None:
    """(floor name, floor) of a ``megatron.trainer`` module; None for the package itself."""
    parts = module.split(".")
    if parts[:2] != ["megatron", "trainer"] or len(parts) == 2:
        return None
    return parts[2], TRAINER_FLOORS[parts[2]]


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    return import_graph()


def test_no_module_cycle(graph):
    cycles = strongly_connected(graph)
    assert not cycles, "modules importing each other in a circle:\n" + "\n".join(", ".join(c) for c in cycles)


def test_every_trainer_package_has_a_floor():
    names = {p.stem if p.is_file() else p.name for p in (ROOT / "trainer").iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert names == set(TRAINER_FLOORS), "a trainer package without a floor in TRAINER_FLOORS (or a stale one)"


def test_trainer_imports_run_downward(graph):
    upward = []
    for module, targets in graph.items():
        here = floor_of(module)
        for target, line in targets.items():
            there = floor_of(target)
            if target == "megatron.trainer" and module.startswith("megatron.trainer."):
                continue
            if module == "megatron.trainer" and there is not None and there[1] > 0:
                upward.append(f"{module}:{line} -> {target} (the package's __init__ runs before every floor)")
            elif here is not None and there is not None and there[1] > here[1]:
                upward.append(f"{module}:{line} -> {target} ({here[0]} is below {there[0]})")
    assert not upward, "imports against the trainer's order:\n" + "\n".join(sorted(upward))


def test_pipeline_imports_neither_runtime_nor_trainer(graph):
    upward = []
    for module, targets in graph.items():
        for target, line in targets.items():
            if module.startswith("megatron.pipeline") and target.startswith("megatron.trainer"):
                upward.append(f"{module}:{line} -> {target}")
            pure = module.startswith("megatron.pipeline") and not module.startswith("megatron.pipeline.runtime")
            if pure and target.startswith("megatron.pipeline.runtime"):
                upward.append(f"{module}:{line} -> {target} (the pure library imports its runtime)")
    assert not upward, "imports against the pipeline library's order:\n" + "\n".join(sorted(upward))


def test_relative_submodule_and_type_only_imports_are_arrows(tmp_path):
    """``from . import sub`` imports the submodule, and an import under ``TYPE_CHECKING`` or
    inside a function is an arrow too (it ties the two modules' designs all the same)."""
    pkg = tmp_path / "megatron" / "pkg"
    pkg.mkdir(parents=True)
    for name in ("__init__", "sub", "other", "lazy"):
        (pkg / f"{name}.py").write_text("")
    mod = pkg / "mod.py"
    mod.write_text("from typing import TYPE_CHECKING\nfrom . import sub\n"
                   "if TYPE_CHECKING:\n    from megatron.pkg import other\n"
                   "def f():\n    import megatron.pkg.lazy\n")
    mods = {"megatron.pkg": pkg / "__init__.py", "megatron.pkg.mod": mod,
            **{f"megatron.pkg.{name}": pkg / f"{name}.py" for name in ("sub", "other", "lazy")}}
    assert set(import_graph(mods)["megatron.pkg.mod"]) == {
        "megatron.pkg.sub", "megatron.pkg.other", "megatron.pkg.lazy"}


def test_the_checks_catch_a_cycle_and_an_upward_arrow():
    """The checks themselves can fail: a made-up circle and a made-up upward arrow are found."""
    toy = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}
    assert strongly_connected(toy) == [["a", "b", "c"]]
    assert floor_of("megatron.trainer.config.job_config") == ("config", 1)
    assert floor_of("megatron.trainer.loop.trainer")[1] > floor_of("megatron.trainer.launch.launcher")[1]
