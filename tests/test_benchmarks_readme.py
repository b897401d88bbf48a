"""``benchmarks/``'s top level is what a user runs: at most 12 scripts, each a row of its README's
table, and the results page stays short enough to read (issue 30)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def _top_level_scripts() -> list[str]:
    return sorted(p.name for p in BENCHMARKS.glob("*.py"))


def test_at_most_twelve_top_level_scripts() -> None:
    scripts = _top_level_scripts()
    assert len(scripts) <= 12, f"benchmarks/ holds {len(scripts)} scripts at its top level: {scripts}"


def test_every_top_level_script_is_a_readme_row() -> None:
    rows = re.findall(r"^\| `([\w.]+\.py)` \|", (BENCHMARKS / "README.md").read_text(), flags=re.M)
    assert sorted(rows) == _top_level_scripts()


def test_readme_commands_name_existing_scripts() -> None:
    for page in (BENCHMARKS / "README.md", ROOT / "docs" / "benchmarks.md"):
        for script in re.findall(r"python (benchmarks/[\w/]+\.py)", page.read_text()):
            assert (ROOT / script).is_file(), f"{page.name} runs {script}, which does not exist"


def test_results_page_length() -> None:
    assert len((ROOT / "docs" / "benchmarks.md").read_text().splitlines()) <= 400
