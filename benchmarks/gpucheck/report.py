"""``OUT/gpu_check.json`` (one entry per step: status, figures, budget, seconds, commands) and
``OUT/gpu_check.md`` (a table of every step: status, key figures, the command reproducing it)."""
from __future__ import annotations

import json
from pathlib import Path


def _brief(value: object, limit: int = 400) -> str:
    """One table cell: compact JSON, cut at ``limit`` characters (the JSON file has it all)."""
    text = json.dumps(value, separators=(",", ":"), default=str)
    text = text if len(text) <= limit else text[:limit] + "…"
    return text.replace("|", "\\|")


def write(out: Path, header: dict, entries: dict[str, dict]) -> None:
    (out / "gpu_check.json").write_text(json.dumps({"run": header, "steps": entries}, indent=1, default=str))
    lines = [f"# GPU check ({header['mode']}, {header.get('device', '?')})", "",
             f"Budget {header['budget_s']} s, took {header.get('seconds', '?')} s. Logs: `logs/`; every figure: `gpu_check.json`.", "",
             "| step | status | figures | reproduce |", "|---|---|---|---|"]
    for name, e in entries.items():
        figures = {k: v for k, v in e["figures"].items() if k not in ("tests", "tail", "traceback")}
        lines.append(f"| {name} | {e['status']} | {_brief(figures)} | `{e['reproduce']}` |")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
