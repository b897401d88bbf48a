"""``docs/design.md`` cites only modules that exist: every ``megatron/...py`` path and every dotted
``megatron.x.y`` name on the page resolves (a dotted name may end in one attribute: a class or a
function of the module). Why: the page is the newcomer's map of the code; a renamed or removed
module must fail here, not mislead a reader."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "design.md"
PATH = re.compile(r"\bmegatron/[\w/]+\.py\b")
DOTTED = re.compile(r"\bmegatron(?:\.\w+)+")


def _is_module(name: str) -> bool:
    """A module or package of this repository, or of an installed distribution (megatron.core)."""
    local = ROOT.joinpath(*name.split("."))
    if local.with_suffix(".py").is_file() or (local.is_dir() and not name.startswith("megatron.core")):
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def missing_citations(text: str) -> list[str]:
    missing = [p for p in sorted(set(PATH.findall(text))) if not (ROOT / p).is_file()]
    for name in sorted(set(DOTTED.findall(text))):
        module = name.rstrip(".")
        if not (_is_module(module) or _is_module(module.rsplit(".", 1)[0])):
            missing.append(name)
    return missing


def test_every_module_design_md_cites_exists() -> None:
    text = DOC.read_text()
    assert PATH.search(text) and DOTTED.search(text), "the page cites modules; the patterns must find them"
    assert missing_citations(text) == []


def test_a_missing_module_is_reported() -> None:
    text = "`megatron/pipeline/no_such_module.py` and `megatron.pipeline.no_such.Thing`; `megatron.pipeline.replay.ReplayEngine`"
    assert missing_citations(text) == ["megatron/pipeline/no_such_module.py", "megatron.pipeline.no_such.Thing"]
