"""Asynchronous schedules on synthetic-cost stages: throughput, activation and weight memory, drift.

Runs 1f1b (flush every iteration), paci, async-1f1b, pipedream-2bw, pipemare and amdp through the
real distributed runtime (one gloo process per device, one torch thread each) with
``benchmarks/schedule_efficiency.py``'s runner: every stage's forward sleeps T_F and its backward
T_B (``megatron/trainer/tasks/synthetic.py``: sleeps stand in for compute on purpose, so N processes
on 2 cores behave like N devices; an AMDP chunk sleeps the whole T_F / T_B because a micro-batch
passes one chunk per device).

Same per-micro-batch costs and m = N micro-batches per update for every schedule, which each
schedule's constraints allow: 2BW needs m >= N - 1, AMDP's window a multiple of D = N; async-1f1b
updates after every micro-batch (m = 1, N times the iterations, so the same micro-batches per run).
PipeMare runs with T2 (``--pipemare-discrepancy-decay``, default 0.1), i.e. with its delta buffer.

Per row, next to each other:

* measured steady-state time per iteration (the harness's median over log intervals after the
  warm-up, best of ``--repeats``), samples/s (micro-batch size 1) and the ratio to 1F1B-flush;
* the timing simulator's samples/s for the schedule the run executed (built from the same trainer
  flags), from nominal sleeps only: the marginal time of an iteration, ``(makespan(k) -
  makespan(k/2)) / (k/2)``, i.e. the steady state without start-up and drain;
* peak activations per stage in micro-batches, measured (the runtime's ``peak_inflight_microbatches``
  of its ``--log-json`` records) and simulated (units of M_B), and the measured bytes (KiB);
* weight copies per stage in units of one stage's weights (``SchedulePolicy.weight_copies``, the
  simulator's weight memory: 2BW's stashed version, PipeMare's delta, AMDP's D/2 replicas);
* max weight-version drift, measured (``drift_max``) and simulated.

    python benchmarks/async_schedules_synthetic.py --json async_synthetic.json     # N = 4, 8; best of 2 (~6 min)
    python benchmarks/async_schedules_synthetic.py --stages 4 --repeats 1           # ~1.5 min
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from megatron.pipeline.schedules import build_schedule  # noqa: E402
from megatron.pipeline.costs.op_costs import OpCosts  # noqa: E402
from megatron.pipeline.simulator import simulate_schedule, steady_time_per_update  # noqa: E402
from megatron.trainer.config.arguments import build_parser as trainer_parser  # noqa: E402
from megatron.trainer.plan.parse import parse_args  # noqa: E402
from megatron.trainer.config.run_config import schedule_config  # noqa: E402
from megatron.trainer.tasks.synthetic import SyntheticCostTask  # noqa: E402
from schedule_efficiency import (  # noqa: E402
    Case, Result, best_of, build_parser, markdown_table, plan_cases, run_argv, run_case, host_wake_note)

ASYNC_SCHEDULES = ("1f1b", "paci", "async-1f1b", "pipedream-2bw", "pipemare", "amdp")


def predict(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    """The simulator on the schedule the run's own trainer flags build (nominal sleeps)."""
    parser = trainer_parser("synthetic")
    SyntheticCostTask().add_arguments(parser)
    config = schedule_config(parse_args(run_argv(case, args), parser))
    costs = OpCosts(t_f=args.forward_ms, t_b=args.backward_ms, t_w=args.wgrad_ms)
    k = case.iterations
    build = lambda i: build_schedule(case.schedule, dataclasses.replace(config, num_iterations=i))  # noqa: E731
    full = simulate_schedule(build(k), costs)
    schedule = build_schedule(case.schedule, config)
    return {
        "sim_ms": steady_time_per_update(build, k, costs),
        "sim_peak_mb": full.peak_memory,
        "sim_drift": max(full.max_drift),
        "weight_copies": list(schedule.policy.weight_copies),
    }


def compact(values: list[float], fmt: str = "{:g}") -> str:
    """``4,3,2,1``, or one value when every stage has it."""
    return fmt.format(values[0]) if len(set(values)) == 1 else ",".join(fmt.format(v) for v in values)


COLUMNS = ["schedule", "N", "m/update", "measured ms/iter", "samples/s", "vs 1f1b", "sim samples/s",
           "measured/sim", "peak act mb/stage (measured)", "(sim)", "peak act KiB/stage", "weight copies/stage",
           "max drift (measured / sim)", "load1", "all repeats ms"]


def table(rows: list[dict[str, Any]]) -> str:
    out = []
    for row in rows:
        r: Result = row["result"]
        if r.error:
            cells = [r.schedule, str(r.stages), str(r.microbatches), r.error.replace("|", "/")]
        else:
            peak = r.stage_max
            cells = [
                r.schedule, str(r.stages), str(r.microbatches), f"{r.measured_ms:.1f}", f"{row['samples_s']:.2f}",
                f"{row['vs_1f1b']:.3f}", f"{row['sim_samples_s']:.2f}", f"{row['samples_s'] / row['sim_samples_s']:.3f}",
                compact(peak.get("peak_inflight_microbatches", [])), compact(row["sim_peak_mb"]),
                compact([1024 * x for x in peak.get("peak_activation_mb", [])], "{:.1f}"),
                compact(row["weight_copies"]), f"{max(peak.get('drift_max', [0])):g} / {row['sim_drift']}",
                f"{r.load_after:.1f}", " / ".join(f"{x:.1f}" for x in r.repeat_measured_ms),
            ]
        out.append(cells)
    return markdown_table(COLUMNS, out)


def parser() -> argparse.ArgumentParser:
    """``schedule_efficiency.py``'s flags with this benchmark's defaults, plus ``--pipemare-decay``."""
    p = build_parser()
    p.description = __doc__.split("\n\n")[0]
    p.set_defaults(schedules=list(ASYNC_SCHEDULES), iterations=10, log_interval=2, warmup_intervals=1,
                   repeats=2, nice=-10, baseline=False)
    p.add_argument("--pipemare-decay", type=float, default=0.1,
                   help="PipeMare's T2 decay D (--pipemare-discrepancy-decay); 0: run PipeMare without T2")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.combine or args.baseline:
        p.error("--combine and --baseline belong to schedule_efficiency.py's sweep")
    args.quick = args.microbatches is None  # plan_cases: m = N per depth unless --microbatches
    cases, skipped = plan_cases(args)
    if args.pipemare_decay:
        cases = [dataclasses.replace(c, extra_args=("--pipemare-discrepancy-decay", str(args.pipemare_decay)))
                 if c.schedule == "pipemare" else c for c in cases]
    # the measured-bytes column needs the activation meter's hooks (off by default)
    cases = [dataclasses.replace(c, extra_args=(*c.extra_args, "--log-activation-memory")) for c in cases]
    workdir_ctx = tempfile.TemporaryDirectory(prefix="async-synthetic-") if args.workdir is None else None
    workdir = Path(args.workdir or workdir_ctx.name)  # type: ignore[union-attr]
    workdir.mkdir(parents=True, exist_ok=True)
    uptime = lambda: Path("/proc/loadavg").read_text().split()[:3]  # noqa: E731
    print(f"# async schedules on synthetic-cost stages: t_f={args.forward_ms:g} ms, t_b={args.backward_ms:g} ms, "
          f"{args.iterations} iterations (async-1f1b: x N), log interval {args.log_interval}, "
          f"{args.warmup_intervals} warm-up interval(s) skipped, best of {args.repeats}; {os.cpu_count()} CPU cores, "
          f"gloo, 1 torch thread per rank, nice {args.nice}; load average (1/5/15 min) {' '.join(uptime())}; "
          f"{host_wake_note(args.forward_ms / 1000)}",
          flush=True)
    t0 = time.perf_counter()
    runs: list[list[Result]] = [[] for _ in cases]
    for rep in range(args.repeats):
        for i, case in enumerate(cases):
            r = run_case(case, args, workdir)
            print(f"#   [{rep + 1}/{args.repeats}] {case.schedule:>13} N={case.stages} m={case.microbatches}: "
                  f"{r.error or f'{r.measured_ms:.1f} ms/iter'}  [run {r.run_wall_s:.0f}s, load {r.load_after:.1f}]",
                  file=sys.stderr, flush=True)
            runs[i].append(r)
    rows: list[dict[str, Any]] = []
    for case, r in zip(cases, (best_of(rs) for rs in runs)):
        row: dict[str, Any] = {"result": r}
        if not r.error:
            row.update(predict(case, args), samples_s=1000.0 * r.microbatches / r.measured_ms)
            row["sim_samples_s"] = 1000.0 * r.microbatches / row["sim_ms"]
        rows.append(row)
    for row in rows:  # ratio to 1F1B-flush at the same depth (and m, when 1F1B ran it)
        refs = [x for x in rows if x["result"].schedule == "1f1b" and x["result"].stages == row["result"].stages
                and not x["result"].error]
        ref = next((x for x in refs if x["result"].microbatches == row["result"].microbatches), refs[0] if refs else None)
        if not row["result"].error:
            row["vs_1f1b"] = row["samples_s"] / ref["samples_s"] if ref else float("nan")
    rows += [{"result": r} for r in skipped]
    order = {name: i for i, name in enumerate(args.schedules)}
    rows.sort(key=lambda x: (x["result"].stages, order.get(x["result"].schedule, len(order))))
    print()
    print(table(rows))
    print()
    for row in rows:
        if row["result"].note:
            print(f"# note {row['result'].schedule} N={row['result'].stages}: {row['result'].note}")
    loads = [x for rs in runs for r in rs if not r.error for x in (r.load_before, r.load_after)]
    if loads:
        print(f"# 1-minute load average around the runs: {min(loads):.1f} .. {max(loads):.1f} on {os.cpu_count()} "
              f"cores; at the end (1/5/15 min): {' '.join(uptime())} (other work on the host adds noise)")
    print(f"# total wall time {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"settings": vars(args), "rows": [{**{k: v for k, v in row.items() if k != "result"},
                                               "result": dataclasses.asdict(row["result"])} for row in rows]},
            indent=2, default=str))
    if workdir_ctx is not None:
        workdir_ctx.cleanup()
    return 1 if any(row["result"].error for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
