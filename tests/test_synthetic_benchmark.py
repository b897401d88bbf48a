"""The synthetic-cost schedule-efficiency benchmark, in a tiny configuration.

Runs ``benchmarks/schedule_efficiency.py`` for 1F1B with N=2 stages, m=2 micro-batches and
3 iterations through the real distributed runtime (2 gloo processes), then checks that its
markdown table parses and that the measured time per iteration respects the sleeps: every
stage sleeps ``m * (t_f + t_b)`` per iteration, and 1F1B's dependency chain sleeps
``(m + N - 1) * (t_f + t_b)``, so a smaller measurement means the runtime skipped work. The
upper bound is generous: a loaded 2-core machine adds scheduling latency to every op.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "benchmarks" / "schedule_efficiency.py"

N, M, T_F, T_B = 2, 2, 10.0, 20.0


def _parse_markdown_table(text: str) -> list[dict[str, str]]:
    lines = [line for line in text.splitlines() if line.startswith("|")]
    assert len(lines) >= 3, f"no markdown table in the output:\n{text}"
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert set(lines[1].strip("|").split("|")) == {"---"}, lines[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert all(len(r) == len(header) for r in rows), rows
    return [dict(zip(header, r)) for r in rows]


@pytest.mark.slow
def test_schedule_efficiency_harness_tiny(tmp_path: Path) -> None:
    out_json = tmp_path / "result.json"
    cmd = [
        sys.executable, str(HARNESS),
        "--stages", str(N), "--microbatches", str(M), "--schedules", "1f1b",
        "--iterations", "3", "--log-interval", "1", "--warmup-intervals", "1",
        "--forward-ms", str(T_F), "--backward-ms", str(T_B), "--no-baseline",
        "--json", str(out_json), "--workdir", str(tmp_path / "logs"), "--run-timeout", "100",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    rows = _parse_markdown_table(proc.stdout)
    assert len(rows) == 1, rows
    row = rows[0]
    assert (row["schedule"], row["N"], row["m"]) == ("1f1b", str(N), str(M))
    ideal = M * (T_F + T_B)
    analytic = (M + N - 1) * (T_F + T_B)
    assert float(row["ideal m(tf+tb) ms"]) == pytest.approx(ideal)
    assert float(row["analytic ms"]) == pytest.approx(analytic)
    measured = float(row["measured ms"])
    assert measured >= ideal, f"measured {measured} ms < sleep floor {ideal} ms: work was skipped"
    assert measured >= 0.99 * analytic, f"measured {measured} ms beats 1F1B's critical path {analytic} ms"
    assert measured < 2 * analytic + 50, f"measured {measured} ms vs analytic {analytic} ms"
    assert float(row["analytic eff"]) == pytest.approx(M / (M + N - 1), abs=1e-3)
    assert float(row["measured eff"]) == pytest.approx(ideal / measured, abs=2e-3)

    payload = json.loads(out_json.read_text())
    (result,) = payload["results"]
    assert result["error"] is None
    assert result["timed_iterations"] == 2  # iterations 2..3; the first interval is warm-up
    assert result["measured_ms"] == pytest.approx(measured, abs=0.05)
