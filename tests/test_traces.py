"""Run traces (``--trace-dir``) and ``tools/merge_traces.py``: a traced 4-stage run of 1F1B and
PACI through the real distributed runtime on the synthetic-cost model (sleeps stand in for
compute, so 4 processes on 2 cores behave like 4 devices) gives a valid Chrome trace, a PNG,
and measured per-stage bubble fractions that agree with the timing simulator.

Tolerance: 0.05 *absolute* on each stage's bubble fraction (idle share of the stage's span),
not 5 % relative: PACI's last stage idles ~1 % of its span, where a relative error means
nothing, and the bubble fraction is itself a share of time, so percentage points are its
natural unit. The simulator replays the recorded streams with the measured median op times
and the measured message latency (``trace_analysis.simulate_trace``), so what it cannot see
is jitter: on a shared 2-core host a run whose op times vary a lot (load spikes) is retried,
and the best of three runs is checked.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "benchmarks" / "harness" / "synthetic_stage_run.py"
N, M, ITERS, T_F, T_B = 4, 4, 2, 20.0, 40.0
TOLERANCE = 0.05
_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "MEGATRON_ASYNC_LAUNCHED")


def _traced_run(schedule: str, trace_dir: Path) -> None:
    cmd = [sys.executable, str(RUN), "--pipeline-model-parallel-size", str(N), "--num-layers", str(N),
           "--pipeline-schedule", schedule, "--micro-batch-size", "1", "--global-batch-size", str(M),
           "--seq-length", "4", "--hidden-size", "8", "--num-attention-heads", "1",
           "--train-iters", str(ITERS), "--log-interval", str(ITERS), "--device", "cpu",
           "--num-threads", "1", "--synthetic-forward-ms", str(T_F), "--synthetic-backward-ms", str(T_B),
           "--trace-dir", str(trace_dir)]
    env = {k: v for k, v in os.environ.items() if k not in _RANK_ENV}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _merge(trace_dir: Path, tmp: Path) -> tuple[dict, dict, Path]:
    """``tools/merge_traces.py DIR --out --png --json``, in this process (no second torch import)."""
    import contextlib
    import io

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tools import merge_traces

    out, png = tmp / "trace.json", tmp / "timeline.png"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = merge_traces.main([str(trace_dir), "--out", str(out), "--png", str(png), "--json"])
    assert code == 0
    return json.loads(out.read_text()), json.loads(stdout.getvalue()), png


def _check_chrome_trace(trace: dict) -> None:
    """Chrome trace-event format: complete events with name/ph/ts/dur/pid/tid, no overlap per thread."""
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["ph"] for e in events} <= {"X", "M"}
    for e in events:
        assert {"name", "ph", "pid", "tid", "ts"} <= set(e), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
    for e in complete:
        assert isinstance(e["name"], str) and isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
        assert e["dur"] >= 0 and e["ts"] >= 0
    assert {e["pid"] for e in complete} == set(range(N))
    by_thread: dict[tuple[int, int], list[dict]] = {}
    for e in complete:
        by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    for key, evs in by_thread.items():
        evs.sort(key=lambda e: e["ts"])
        for a, b in zip(evs, evs[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, f"{key}: {a['name']} overlaps {b['name']}"
    f_ops = [e for e in complete if e["cat"] == "F"]
    assert len(f_ops) == N * M * ITERS


def _worst_gap(report: dict) -> float:
    return max(abs(r["bubble_fraction"] - r["sim_bubble_fraction"]) for r in report["stages"])


@pytest.mark.parametrize("schedule", ["1f1b", "paci"])
def test_traced_run_matches_simulator(schedule: str, tmp_path: Path) -> None:
    reports = []
    for attempt in range(3):
        trace_dir = tmp_path / f"traces{attempt}"
        _traced_run(schedule, trace_dir)
        assert sorted(p.name for p in trace_dir.iterdir()) == [f"stage{s}_dp0.json" for s in range(N)]
        trace, report, png = _merge(trace_dir, tmp_path / f"m{attempt}")
        _check_chrome_trace(trace)
        assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        reports.append(report)
        if _worst_gap(report) <= TOLERANCE:
            break
    best = min(reports, key=_worst_gap)
    rows = [[(r["stage"], round(r["bubble_fraction"], 3), round(r["sim_bubble_fraction"], 3)) for r in rep["stages"]]
            for rep in reports]
    # The sleeps are a floor: every F/BW of the trace lasts at least its sleep.
    costs = best["costs_ms"]
    assert all(c["t_f"] >= T_F and c["t_bw"] >= T_B for c in costs), costs
    assert _worst_gap(best) <= TOLERANCE, f"{schedule}: (stage, measured, simulated) bubble fractions per attempt {rows}"


def test_emulator_traces_are_retimed(tmp_path: Path) -> None:
    """The emulator traces too (one file per stage, same format); the merge re-times its serial
    timestamps through the replay, so each stage's ops keep their durations and order and no
    op starts before its inputs exist. Fast: in process, 2 stages, 1 ms sleeps."""
    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.tasks.synthetic import SyntheticCostTask
    from megatron.trainer.loop.training import emulate

    task = SyntheticCostTask()
    parser = build_parser("synthetic")
    task.add_arguments(parser)
    trace_dir = tmp_path / "traces"
    argv = ["--pipeline-executor", "emulator", "--pipeline-model-parallel-size", "2", "--num-layers", "2",
            "--pipeline-schedule", "1f1b", "--micro-batch-size", "1", "--global-batch-size", "3",
            "--seq-length", "4", "--hidden-size", "8", "--num-attention-heads", "1", "--train-iters", "2",
            "--log-interval", "2", "--device", "cpu", "--num-threads", "1",
            "--synthetic-forward-ms", "1", "--synthetic-backward-ms", "2"]
    workers = emulate(task, parse_run_plan([*argv, "--trace-dir", str(trace_dir)], parser))
    assert all(w.tracer is None for w in workers)  # tracing is on during training segments only
    files = sorted(p.name for p in trace_dir.iterdir())
    assert files == ["stage0_dp0.json", "stage1_dp0.json"]
    data = json.loads((trace_dir / "stage1_dp0.json").read_text())
    assert data["executor"] == "emulator" and data["num_stages"] == 2
    kinds = [op[0] for op in data["ops"]]
    assert kinds.count("F") == 6 and kinds.count("BW") == 6 and kinds.count("OPT") == 2
    trace, report, png = _merge(trace_dir, tmp_path / "m")
    assert report["retimed"] and report["executor"] == "emulator"
    assert png.read_bytes()[:4] == b"\x89PNG"
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 2 * (6 + 6 + 2)
    for r in report["stages"]:
        assert 0.0 <= r["bubble_fraction"] < 1.0 and r["busy_ms"] >= 3 * (1 + 2)
