"""The schedule layer is pure: importing it loads the standard library and itself, nothing else.

The pure part of :mod:`megatron.pipeline` is every module directly in ``megatron/pipeline/``
and ``megatron/pipeline/schedules/`` (IR, comm, schedules, schedule check, simulator, replay,
partition, trace analysis, post-validation's streams and decisions, weight-policy specs).
Everything that needs tensors lives in ``megatron/pipeline/runtime/``.

Why standard library only, not just "no torch": the layer is plain Python over ints and
floats. Allowing any third-party package would let one pull torch back in transitively (numpy
is no better: nothing here computes on arrays, and an array library is the first step
towards tensors here). A module that truly needs a dependency must be moved out of the pure
part or this rule changed on purpose, not by accident.

Two independent checks:

* dynamic: one fresh interpreter imports every pure module and reports what was loaded that
  is neither the standard library nor a pure module (``torch``, ``numpy``, ``megatron.core``,
  ``megatron.trainer``, ``megatron.pipeline.runtime`` ...);
* static: no pure module names such a module in any import statement, at any depth (inside
  functions and ``if TYPE_CHECKING:`` blocks too), so a lazy import cannot slip torch back in
  on a code path the dynamic check does not run.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "megatron" / "pipeline"
#: the pure packages; a schedule family's sub-package (schedules/zero_bubble/, ...) is pure with them
PURE_DIRS = (PIPELINE, PIPELINE / "costs", PIPELINE / "planner", *sorted(
    d for d in (PIPELINE / "schedules").rglob("*") if d.is_dir() and (d / "__init__.py").is_file()),
    PIPELINE / "schedules")
RUNTIME_DIR = PIPELINE / "runtime"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


PURE_FILES = sorted(f for d in PURE_DIRS for f in d.glob("*.py"))
PURE_MODULES = frozenset(module_name(f) for f in PURE_FILES)


def allowed(name: str) -> bool:
    """A module the pure part may load: the standard library, a pure module or a package of one."""
    top = name.split(".")[0]
    if top in sys.stdlib_module_names:
        return True
    return name in PURE_MODULES or any(m.startswith(name + ".") for m in PURE_MODULES)


def _is_module_path(name: str) -> bool:
    """``name`` is a module or package of this repository (not an attribute of one)."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or path.is_dir()


def _imported_names(tree: ast.AST, package: str) -> Iterator[tuple[int, str]]:
    """(line, module) for every module an import in ``tree`` names, at any nesting depth.

    ``from a import b`` names ``a`` and, when ``b`` is a submodule of this repository,
    ``a.b``; ``importlib.import_module("x")`` and ``__import__("x")`` with a literal name
    count too.
    """
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:
                if _is_module_path(f"{module}.{alias.name}"):
                    yield node.lineno, f"{module}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if fname in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def static_violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports of ``source`` (module ``module``) the pure part may not make."""
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(source)
    return [f"{module}:{line}: imports {name}" for line, name in _imported_names(tree, package)
            if not allowed(name)]


_PROBE = """
import importlib, json, sys
before = set(sys.modules)
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def loaded_by(modules: Iterable[str]) -> list[str]:
    """The modules a fresh interpreter loads while importing ``modules`` (from the repo root)."""
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(sorted(modules))], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


# ------------------------------------------------------------------------------ tests


def test_the_pure_part_is_where_the_split_says() -> None:
    """Every sub-package of megatron.pipeline is classified, and the core modules are pure."""
    subpackages = {p.name for p in PIPELINE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert subpackages == {"schedules", "costs", "planner", "runtime"}, (
        f"megatron/pipeline has sub-packages {sorted(subpackages)}: add a new one to the pure part "
        f"(PURE_DIRS) or move it under runtime/")
    for core in ("ir", "comm", "replay", "schedule_check", "simulator", "costs.partition", "trace_analysis",
                 "trace_format", "schedules.zero_bubble.post_validation", "weight_policy", "schedules",
                 "schedules.base"):
        assert f"megatron.pipeline.{core}" in PURE_MODULES


def test_importing_the_pure_part_loads_only_the_standard_library() -> None:
    extra = [m for m in loaded_by(PURE_MODULES) if not allowed(m)]
    # name packages, not their hundreds of submodules; megatron's down to the offending part
    named = sorted({".".join(m.split(".")[:3]) if m.startswith("megatron.") else m.split(".")[0] for m in extra})
    assert not extra, f"importing the schedule layer loads {', '.join(named)}"


def test_no_pure_module_imports_torch_the_runtime_or_the_trainer() -> None:
    found = [v for f in PURE_FILES
             for v in static_violations(f.read_text(), module_name(f), f.name == "__init__.py")]
    assert not found, "\n".join(found)


def test_the_checks_catch_a_lazy_or_relative_import() -> None:
    """The checks can fail: a torch import hidden in a function, the runtime through a relative
    import or a TYPE_CHECKING block, and a third-party module actually loaded."""
    source = (
        "from __future__ import annotations\n"
        "import math\n"
        "from typing import TYPE_CHECKING\n"
        "from megatron.pipeline.ir import Op\n"
        "if TYPE_CHECKING:\n"
        "    from megatron.trainer.loop import training\n"
        "def f():\n"
        "    import torch.nn\n"
        "from ..runtime import worker\n"
        "from megatron.pipeline import runtime\n"
        "import importlib\n"
        "np = importlib.import_module('numpy')\n"
    )
    found = static_violations(source, "megatron.pipeline.schedules.example")
    assert sorted(v.split(": imports ")[1] for v in found) == [
        "megatron.pipeline.runtime", "megatron.pipeline.runtime", "megatron.pipeline.runtime.worker",
        "megatron.trainer.loop", "megatron.trainer.loop.training", "numpy", "torch.nn"], found
    assert static_violations("import json\nfrom . import base\n", "megatron.pipeline.schedules.x") == []
    assert "pluggy" in [m for m in loaded_by(["pluggy"]) if not allowed(m)]  # pytest's own dependency
