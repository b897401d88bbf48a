"""Merge the per-stage traces of a run (``--trace-dir DIR``) into one Chrome/Perfetto trace,
a paper-style timeline PNG, and measured bubble fractions next to the simulator's.

    python pretrain_gpt.py ... --trace-dir traces
    python tools/merge_traces.py traces --out trace.json --png timeline.png
    python tools/merge_traces.py traces --skip-iterations 1 --json      # leave out the start-up iteration

Bubble fraction per stage: the timing simulator's definition (``megatron/pipeline/simulator.py``),
i.e. idle time between the stage's first op start and last op end (a final synchronous step
counted from the op before it) over that span. *sim* is the simulator on the same recorded op
streams with each stage's measured median op durations, its measured dispatch time between ops
(counted as idle, as in the trace) and the measured message latency (median time from a send to
the start of the op that waited for it), so measured - sim is jitter, not a difference of
schedule or cost.

Emulator traces (``--pipeline-executor emulator``) come from one process running every stage in
turn; they are re-timed (each op keeps its measured duration, the replay places it) before any
of the above, and the output says so. The PNG and *sim* use data-parallel replica 0.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron.pipeline.trace_analysis import (  # noqa: E402
    StageTrace,
    as_result,
    bubble_rate,
    chrome_trace,
    layout_of,
    load_traces,
    replica,
    retime,
    simulate_trace,
    skip_iterations,
    stage_bubble,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace_dir", help="the run's --trace-dir")
    ap.add_argument("--out", help="write the merged Chrome/Perfetto trace JSON here")
    ap.add_argument("--png", help="draw the timeline (replica 0) to this file (needs matplotlib)")
    ap.add_argument("--skip-iterations", type=int, default=0,
                    help="leave out the ops of the first K updates from the bubble numbers and the PNG "
                         "(start-up costs; meant for synchronous schedules: in an asynchronous stream the "
                         "left-out micro-batches' backwards sit between kept ops and would show as idle)")
    ap.add_argument("--json", action="store_true", help="print the bubble numbers as JSON only")
    return ap.parse_args(argv)


def analyse(traces: list[StageTrace], skip: int = 0) -> dict[str, Any]:
    """Measured and simulated bubbles of replica 0 (plus every rank's measured bubble)."""
    layout = layout_of(traces)
    a = int(traces[0].meta.get("microbatches_per_update", 1))
    retimed = traces[0].executor == "emulator"
    per_rank = []
    for t in traces:
        spans = skip_iterations(t.spans, skip, a)
        per_rank.append((t, spans))
    rep = [spans for t, spans in per_rank if t.dp_rank == 0]
    replica(traces, 0)  # all stages present
    if retimed:
        rep = retime(rep, layout)
    measured = [stage_bubble(s) for s in rep]
    if retimed:  # the replay placed every op back to back: no latency, no dispatch gaps
        sim = simulate_trace(rep, layout, t_comm=0.0, overhead=[0.0] * layout.num_stages)
    else:
        sim = simulate_trace(rep, layout)
    rows = []
    for s, m in enumerate(measured):
        rows.append({"stage": s, "busy_ms": m.busy, "span_ms": m.span, "bubble_ms": m.bubble,
                     "bubble_fraction": m.fraction, "sim_span_ms": sim.result.stage_span[s],
                     "sim_bubble_fraction": sim.bubble_fraction[s], "dispatch_ms": sim.overhead[s], "ops": len(rep[s])})
    ranks = []
    if not retimed:
        for t, spans in per_rank:
            b = stage_bubble(spans)
            ranks.append({"stage": t.stage, "dp_rank": t.dp_rank, "bubble_fraction": b.fraction,
                          "span_ms": b.span, "busy_ms": b.busy})
    return {
        "schedule": traces[0].meta.get("schedule"), "executor": traces[0].executor, "retimed": retimed,
        "num_stages": layout.num_stages, "skip_iterations": skip, "stages": rows, "ranks": ranks,
        "bubble_rate": bubble_rate(measured), "sim_bubble_rate": sim.bubble_rate, "t_comm_ms": sim.t_comm,
        "costs_ms": [{"stage": s, "t_f": c.t_f, "t_b": c.t_b, "t_w": c.t_w, "t_bw": c.fused_backward,
                      "t_opt": c.t_opt} for s, c in enumerate(sim.result.costs)],
        "_spans": rep,
    }


def format_table(report: dict[str, Any]) -> str:
    lines = [f"{report['schedule']} ({report['executor']}{', re-timed' if report['retimed'] else ''}), "
             f"{report['num_stages']} stages, skipping {report['skip_iterations']} iteration(s); times in ms", ""]
    lines.append(f"{'stage':>5} {'busy':>10} {'span':>10} {'bubble':>10} {'bubble %':>9} {'sim bubble %':>13} {'ops':>6}")
    for r in report["stages"]:
        lines.append(f"{r['stage']:>5} {r['busy_ms']:>10.2f} {r['span_ms']:>10.2f} {r['bubble_ms']:>10.2f} "
                     f"{100 * r['bubble_fraction']:>8.2f}% {100 * r['sim_bubble_fraction']:>12.2f}% {r['ops']:>6}")
    dispatch = ", ".join(f"{r['dispatch_ms']:.2f}" for r in report["stages"])
    lines += ["", f"bubble rate  measured {report['bubble_rate']:.4f}   simulated {report['sim_bubble_rate']:.4f}"
              "  ((max span - max busy) / max span)",
              f"simulated with each stage's measured median op times plus its dispatch time between ops "
              f"({dispatch} ms, idle in both columns) "
              f"and the measured message latency t_comm = {report['t_comm_ms']:.2f} ms"]
    if len(report["ranks"]) > report["num_stages"]:
        lines.append("per rank: " + ", ".join(f"s{r['stage']}/dp{r['dp_rank']} {100 * r['bubble_fraction']:.1f}%"
                                             for r in report["ranks"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("error: --png needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
    try:
        traces = load_traces(args.trace_dir)
        report = analyse(traces, args.skip_iterations)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    spans = report.pop("_spans")
    for path in (args.out, args.png):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if args.out:
        Path(args.out).write_text(json.dumps(chrome_trace(traces)))
    if args.png:
        from tools.simulate_schedule import draw_timeline

        title = (f"{report['schedule']} measured ({report['executor']}{', re-timed' if report['retimed'] else ''}): "
                 f"N={report['num_stages']}, bubble rate {report['bubble_rate']:.4f} "
                 f"(simulated {report['sim_bubble_rate']:.4f}); time in ms")
        draw_timeline(as_result(spans), args.png, title)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    if not args.json:
        for what, path in (("Chrome trace", args.out), ("timeline", args.png)):
            if path:
                print(f"{what} written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
