"""The runtime's parts have one job each (issue #40, item 5), checked on the source.

``torch.distributed.pipelining`` is the model: stage compute, the schedule runtime and
data-parallel wrapping are separate objects. Here that means: no import circle in
``megatron/pipeline`` even counting type-only imports (a circle there ties the designs together
as much as a runtime one does); the transport moves tensors and knows nothing of the worker;
and a worker's tracer, profiler and gradient sync are given at construction, never assigned
from outside (their owners switch them through methods of the worker's own objects).
"""
from __future__ import annotations

import ast
from collections.abc import Iterator

from tests.test_import_graph import ROOT, import_graph, strongly_connected

#: Circles other parts of issue #40 remove (the schedules' refactor), allowed until they do:
#: each entry must match a whole circle exactly, so a larger circle through it still fails.
WORKER = "megatron.pipeline.runtime.worker"
TRANSPORT = "megatron.pipeline.runtime.transport"
OWNED = frozenset({"tracer", "profiler", "grad_sync"})


def pipeline_graph() -> dict[str, set[str]]:
    """``megatron.pipeline``'s modules and what they import of it, type-only imports included."""
    return {name: {d for d in targets if d.startswith("megatron.pipeline")}
            for name, targets in import_graph().items() if name.startswith("megatron.pipeline")}


def test_no_import_cycle_in_the_pipeline_counting_type_only_imports() -> None:
    cycles = strongly_connected(pipeline_graph())
    assert not cycles, "import circles in megatron/pipeline (type-only imports counted):\n" + "\n".join(
        "  " + " <-> ".join(c) for c in cycles)


def test_the_transport_imports_nothing_of_the_worker() -> None:
    """Not even under TYPE_CHECKING: what a channel needs of a stage is a protocol."""
    graph = pipeline_graph()
    transport = sorted(m for m in graph if m == TRANSPORT or m.startswith(TRANSPORT + "."))
    assert transport, "no transport modules found"
    offenders = [m for m in transport if WORKER in graph[m]]
    assert not offenders, f"{offenders} import {WORKER}"


def _assignments(tree: ast.AST) -> Iterator[tuple[ast.AST, list[str]]]:
    """Every assigned attribute target under ``tree`` as (target, names of enclosing functions)."""
    def walk(node: ast.AST, functions: list[str]) -> Iterator[tuple[ast.AST, list[str]]]:
        for child in ast.iter_child_nodes(node):
            inner = [*functions, child.name] if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else functions
            targets: list[ast.expr] = []
            if isinstance(child, ast.Assign):
                targets = list(child.targets)
            elif isinstance(child, (ast.AnnAssign, ast.AugAssign)):
                targets = [child.target]
            while targets:
                target = targets.pop()
                if isinstance(target, (ast.Tuple, ast.List)):
                    targets.extend(target.elts)
                elif isinstance(target, ast.Attribute):
                    yield target, functions
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id == "setattr" \
                    and len(child.args) >= 2 and isinstance(child.args[1], ast.Constant):
                yield child, functions
            yield from walk(child, inner)
    yield from walk(tree, [])


def owned_assignments_outside_constructors(source: str, where: str) -> list[str]:
    """``x.tracer = ...`` (and ``.profiler``, ``.grad_sync``, or a ``setattr`` of them) anywhere
    but ``self.<name> = ...`` directly in an ``__init__``."""
    found = []
    for node, functions in _assignments(ast.parse(source, where)):
        if isinstance(node, ast.Call):
            if node.args[1].value in OWNED:  # type: ignore[attr-defined]
                found.append(f"{where}:{node.lineno}")
            continue
        assert isinstance(node, ast.Attribute)
        if node.attr not in OWNED:
            continue
        in_constructor = functions[-1:] == ["__init__"] and isinstance(node.value, ast.Name) and node.value.id == "self"
        if not in_constructor:
            found.append(f"{where}:{node.lineno}")
    return found


def test_the_scan_finds_assignments_from_outside() -> None:
    source = ("class W:\n    def __init__(self, tracer):\n        self.tracer = tracer\n"
              "    def swap(self):\n        self.profiler, x = None, 1\n"
              "def run(w):\n    w.grad_sync = None\n    setattr(w, 'tracer', None)\n    w.other = 1\n")
    assert owned_assignments_outside_constructors(source, "m.py") == ["m.py:5", "m.py:7", "m.py:8"]


def test_tracer_profiler_and_grad_sync_are_assigned_in_constructors_only() -> None:
    found = [hit for path in sorted((ROOT / "megatron").rglob("*.py"))
             for hit in owned_assignments_outside_constructors(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "assigned outside a constructor: " + ", ".join(found)
