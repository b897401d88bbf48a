"""No code outside the schedule package knows a schedule by name (issue 14).

A name comparison (``args.pipeline_schedule == "amdp"``, ``name in ("zb-1p", "zb-2p")``) is
how per-schedule behaviour leaks into the trainer: the next schedule then needs edits in every
such place. Schedules declare their flags, checks and capabilities on their class instead, and
the trainer asks the class.

What counts: any string constant in ``megatron/`` (outside ``megatron/pipeline/schedules/``),
``pretrain_*.py`` or ``tools/`` that *equals* a registered schedule name. That catches
comparisons, tuples of names and defaults alike. What does not count, and why:

* docstrings (they explain, they do not dispatch), and prose that merely *mentions* a name
  (a help text or message containing "zb-1p" is not equal to it). Help texts of schedule flags
  come from the schedules' own declarations, and lists of names in messages are built from
  the registry (``megatron.pipeline.schedules.flag_groups``), so they stay right by construction;
* :data:`EXPERIMENTS`: study definitions that name the schedules they compare as data (a study
  *is* "run paci against 1f1b"), like the example scripts do. They select runs, they do not
  steer the trainer.
"""
from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

from megatron.pipeline.schedules import SCHEDULES

ROOT = Path(__file__).resolve().parents[1]
SCHEDULE_PACKAGE = Path("megatron/pipeline/schedules")
EXPERIMENTS = (Path("megatron/studies/grid.py"), Path("tools/convergence_study.py"))  # study definitions: schedules as data


def scanned_files(root: Path) -> list[Path]:
    """Project code that must not name schedules, relative to ``root``."""
    files = [*root.glob("megatron/**/*.py"), *root.glob("pretrain_*.py"), *root.glob("tools/**/*.py")]
    out = []
    for path in sorted(files):
        rel = path.relative_to(root)
        if rel.is_relative_to(SCHEDULE_PACKAGE) or any(rel.is_relative_to(e) for e in EXPERIMENTS):
            continue
        out.append(rel)
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    """``id`` of every docstring constant (module, class, function)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def name_constants(source: str, names: Iterable[str], filename: str = "<src>") -> Iterator[tuple[int, str]]:
    """``(line, name)`` of every non-docstring string constant in ``source`` equal to a name."""
    names = set(names)
    tree = ast.parse(source, filename)
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
                and id(node) not in docstrings):
            yield node.lineno, node.value


def schedule_name_uses(root: Path) -> list[str]:
    """``file:line: 'name'`` for every violation under ``root``."""
    return [f"{rel}:{line}: {name!r}" for rel in scanned_files(root)
            for line, name in name_constants((root / rel).read_text(), SCHEDULES, str(rel))]


def test_the_scan_catches_comparisons_and_spares_docstrings():
    source = '''"""Module doc naming amdp."""
def f(args):
    """amdp"""
    if args.pipeline_schedule == "amdp":
        return 1
    help_text = "amdp: shards the optimizer"  # prose mentioning a name is fine
    return args.pipeline_schedule in ("zb-1p", "zb-2p")
'''
    assert list(name_constants(source, ("amdp", "zb-1p", "zb-2p"))) == [(4, "amdp"), (7, "zb-1p"), (7, "zb-2p")]


def test_no_schedule_name_outside_the_schedule_package():
    uses = schedule_name_uses(ROOT)
    assert not uses, ("schedule names compared outside megatron/pipeline/schedules/ (declare the behaviour "
                      "on the schedule class and ask the class instead):\n  " + "\n  ".join(uses))
