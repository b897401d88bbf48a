"""Zero Bubble schedules on synthetic-cost stages: measured iteration time vs the timing simulator.

Every stage's F sleeps T_F, its B (input gradient) T_B and its W (weight gradient) T_W; a fused
backward sleeps T_B + T_W (``megatron/trainer/tasks/synthetic.py``: sleeps stand in for compute on
purpose, through the runtime's own weight-gradient deferral). For each cost set, N and m this runs
1f1b, zb-h1, zb-h2, zb-1p and zb-2p through the real distributed runtime (one gloo process per
stage, one torch thread each) with ``benchmarks/schedule_efficiency.py``'s runner, and puts the
measured steady-state time per iteration next to the simulator's makespan of one iteration of the
schedule that actually ran:

* zb-1p / zb-2p profile their first ``--zb-profile-iters`` (2) iterations (ZB-H1) and then run the
  greedy order searched from the *profiled* costs; the run logs those costs and the harness rebuilds
  exactly that order (the greedy is deterministic) before simulating it. The warm-up skips
  ``--warmup-intervals`` (default 2) log intervals, i.e. the profiling iterations and the
  iteration in which the order is searched.
* *sim* uses the nominal sleeps only: the schedule's ideal on a zero-overhead runtime.
* *sim+ovh* adds the runtime's measured costs: ``o`` per op (every F, B, W and BW), from an N = 1
  run of the same costs (no communication: ``(measured - sleeps) / ops``, the existing harness's
  baseline), and ``T_comm``, the one-way P2P latency zb-1p / zb-2p measured by ping-pong while
  profiling (the least loaded of those runs). No synchronous step, no send cost.
* *sim+cal* (``--calibrate``, the default) adds the terms a separate traced calibration run at
  the same depth N measured (``benchmarks/calibrate_runtime.py``, run interleaved with the cases,
  term-wise median over the repeats): the per-op cost at depth N (``--calibrated-per-op depth``,
  the default; ``baseline`` takes ``o`` from the N = 1 run instead), ``t_send`` per message on
  the sender's timeline, ``t_comm`` per message, ``t_sync`` per synchronous step
  (:mod:`megatron.pipeline.costs.calibration`). Nothing in it is solved from the runs it is compared
  with. Measuring the per-op cost at depth N, with N ranks on the host's cores, is how CPU
  oversubscription enters: ops that stretch because ranks queue for a core stretch there too.

Asynchronous schedules (``paci``) may be listed too: their prediction is the simulator's steady
time per update (:func:`~megatron.pipeline.simulator.steady_time_per_update`); their stage-local
steps have no collective, so ``t_sync`` does not apply to them.

The ranks run at ``--nice -10`` by default: on a shared 2-core host other engineers' test suites
otherwise delay every wake-up by milliseconds (the ranks sleep most of the time, so they take
little CPU from the others; without root the niceness stays unchanged and ``nice`` says so).
Every case is run ``--repeats`` times in rounds (all cases once, then again), so load bursts from
other work on the machine hit different cases; each reports its fastest repeat (load only adds
time) and lists all of them. The 1-minute load average is recorded next to every row.

    python benchmarks/zero_bubble_synthetic.py --json zb_synthetic.json            # N = 4, 8; m = N (~25 min)
    python benchmarks/zero_bubble_synthetic.py --stages 4 --costs 20,20,20 --repeats 1   # ~3 min
    python benchmarks/zero_bubble_synthetic.py --stages 4 --costs 20,20,20 --schedules 1f1b zb-h1 zb-2p paci
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from calibrate_runtime import CALIBRATION_NOTE, add_calibration_args, calibration_case, describe, run_calibration  # noqa: E402
from megatron.pipeline.costs.calibration import Calibration, RuntimeTerms, median_calibration  # noqa: E402
from megatron.pipeline.schedules import ScheduleConfig, build_schedule, schedule_class  # noqa: E402
from megatron.pipeline.schedules.zero_bubble.profiled import schedule_from_choice  # noqa: E402
from megatron.pipeline.costs.op_costs import OpCosts  # noqa: E402
from megatron.pipeline.simulator import simulate_schedule, steady_time_per_update  # noqa: E402
from megatron.pipeline.schedules.zero_bubble.zb_1p import ZeroBubbleAuto  # noqa: E402
from schedule_efficiency import Case, Result, best_of, build_parser, host_wake_note, is_asynchronous, run_case  # noqa: E402

ZB_SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "zb-1p", "zb-2p")
# T_F = T_B = T_W, and the Zero Bubble paper's profiled 1.5B-model costs (ms, the Table 6 row used in
# tests/test_zero_bubble_schedules.py: T_F 18.522, T_B 18.086, T_W 9.337), i.e. about 2 : 2 : 1.
DEFAULT_COSTS = ("20,20,20", "18.5,18.1,9.3")


@dataclass(frozen=True)
class CostSet:
    t_f: float
    t_b: float
    t_w: float

    @classmethod
    def parse(cls, text: str) -> "CostSet":
        parts = [float(x) for x in text.split(",")]
        if len(parts) != 3 or min(parts) < 0:
            raise argparse.ArgumentTypeError(f"--costs expects T_F,T_B,T_W (ms, >= 0), got {text!r}")
        return cls(*parts)

    @property
    def label(self) -> str:
        return f"{self.t_f:g}/{self.t_b:g}/{self.t_w:g}"

    def op_costs(self, terms: RuntimeTerms = RuntimeTerms()) -> OpCosts:
        """Simulator costs: the sleeps plus the runtime's ``terms`` (a fused BW is one op)."""
        return terms.apply(OpCosts(t_f=self.t_f, t_b=self.t_b, t_w=self.t_w))


def executed_schedule(result: Result) -> Any:
    """One iteration of the schedule the run executed after its warm-up.

    For zb-1p / zb-2p: the greedy order for the costs the run profiled and logged (and its memory
    limit), which is what every rank derived; otherwise the fixed schedule.
    """
    if issubclass(schedule_class(result.schedule), ZeroBubbleAuto):
        if result.zb_choice is None:
            raise RuntimeError(f"{result.schedule} N={result.stages}: the run logged no profiled order")
        return schedule_from_choice(result.zb_choice)
    return build_schedule(result.schedule, ScheduleConfig(result.stages, result.microbatches, 1))


def per_op_overhead(baseline: Result) -> float:
    """Runtime cost per op without communication: an N = 1 1F1B run has 2m ops (F, fused BW)."""
    return (baseline.measured_ms - baseline.ideal_ms) / (2 * baseline.microbatches)


def least_loaded_t_comm(results: list[Result]) -> float:
    """T_comm from the zb-1p / zb-2p profile with the smallest profiled busy time (least disturbed)."""
    profiles = [r.zb_choice["costs"] for r in results if r.zb_choice]
    if not profiles:
        return 0.0
    best = min(profiles, key=lambda cs: max(c["t_f"] + c["t_b"] + c["t_w"] for c in cs))
    return float(best[0]["t_comm"])


STEADY_ITERATIONS = 8  # asynchronous schedules: time per update between iterations 4 and 8


def iteration_time(result: Result, costs: OpCosts) -> tuple[float, float]:
    """Simulated time of one iteration of what ``result`` ran, and its bubble rate: a synchronous
    schedule's makespan, or an asynchronous one's steady time per update."""
    if is_asynchronous(result.schedule):
        def build(i: int) -> Any:
            return build_schedule(result.schedule, ScheduleConfig(result.stages, result.microbatches, i))
        steady = steady_time_per_update(build, STEADY_ITERATIONS, costs)
        return steady, simulate_schedule(build(STEADY_ITERATIONS), costs).bubble_rate
    sim = simulate_schedule(executed_schedule(result), costs)
    return sim.makespan, sim.bubble_rate


def predict(result: Result, costs: CostSet, ovh: RuntimeTerms, cal: RuntimeTerms | None) -> dict[str, Any]:
    """*sim* (sleeps only), *sim+ovh* (``o`` and profiled ``T_comm``), *sim+cal* (all calibrated terms)."""
    out: dict[str, Any] = {}
    for key, terms in (("sim", RuntimeTerms()), ("sim_ovh", ovh), ("sim_cal", cal)):
        if terms is not None:
            out[f"{key}_ms"], out[f"{key}_bubble_rate"] = iteration_time(result, costs.op_costs(terms))
    return out


COLUMNS = ["costs T_F/T_B/T_W ms", "N", "m", "schedule", "measured ms", "sim ms", "measured/sim",
           "sim+ovh ms", "measured/(sim+ovh)", "sim+cal ms", "measured/(sim+cal)", "sim bubble rate",
           "measured bubble rate", "speedup vs 1f1b (measured / sim)", "load1", "all repeats ms"]


def _ratio_cells(r: dict[str, Any], key: str) -> list[str]:
    if f"{key}_ms" not in r:
        return ["", ""]
    return [f"{r[f'{key}_ms']:.1f}", f"{r['measured_ms'] / r[f'{key}_ms']:.3f}"]


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in rows:
        if r.get("error"):
            cells = [r["costs"], str(r["N"]), str(r["m"]), r["schedule"], r["error"].replace("|", "/")]
            cells += [""] * (len(COLUMNS) - len(cells))
        else:
            cells = [
                r["costs"], str(r["N"]), str(r["m"]), r["schedule"], f"{r['measured_ms']:.1f}",
                *_ratio_cells(r, "sim"), *_ratio_cells(r, "sim_ovh"), *_ratio_cells(r, "sim_cal"),
                f"{r['sim_bubble_rate']:.3f}",
                f"{r['measured_bubble_rate']:.3f}", f"{r['speedup_measured']:.3f} / {r['speedup_sim']:.3f}",
                f"{r['load1']:.1f}", " / ".join(f"{x:.1f}" for x in r["repeats_ms"]),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """``schedule_efficiency.py``'s flags (runner settings) with Zero Bubble defaults, plus ``--costs``."""
    p = build_parser()
    p.description = __doc__.split("\n\n")[0]
    p.set_defaults(schedules=list(ZB_SCHEDULES), iterations=12, warmup_intervals=2, repeats=3, nice=-10)
    p.add_argument("--costs", type=CostSet.parse, nargs="+", default=[CostSet.parse(c) for c in DEFAULT_COSTS],
                   metavar="T_F,T_B,T_W", help=f"cost sets in ms (default: {' '.join(DEFAULT_COSTS)})")
    p.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                   help="run a traced calibration at each N in every round and add the sim+cal prediction")
    p.add_argument("--calibrated-per-op", choices=("depth", "baseline"), default="depth",
                   help="sim+cal's per-op cost: the calibration trace's at depth N, or the N = 1 baseline's o")
    add_calibration_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.combine or args.quick:
        p.error("--combine and --quick belong to schedule_efficiency.py's sweep, not to this benchmark")
    workdir_ctx = tempfile.TemporaryDirectory(prefix="zb-synthetic-") if args.workdir is None else None
    workdir = Path(args.workdir or workdir_ctx.name)  # type: ignore[union-attr]
    workdir.mkdir(parents=True, exist_ok=True)
    # (costs, N, m, schedule) per case; N = 1 1F1B baselines (same costs) give the per-op overhead.
    plan: list[tuple[CostSet, Case]] = []
    for costs in args.costs:
        for n in args.stages:
            if args.calibrate:
                plan.append((costs, calibration_case(n, args, workdir)))
            for m in args.microbatches or [n]:
                plan += [(costs, Case(s, n, m, args.iterations, args.log_interval)) for s in args.schedules]
        for m in sorted({m for n in args.stages for m in (args.microbatches or [n])}):
            plan.append((costs, Case("1f1b", 1, m, args.iterations, args.log_interval, note="baseline")))
    print(f"# Zero Bubble on synthetic-cost stages: {args.iterations} iterations, log interval {args.log_interval}, "
          f"{args.warmup_intervals} warm-up interval(s) skipped, best of {args.repeats} repeat(s); "
          f"{os.cpu_count()} CPU cores, gloo, 1 torch thread per rank; load average {os.getloadavg()[0]:.1f}; "
          f"{host_wake_note(0.02)}", flush=True)
    t0 = time.perf_counter()
    runs: list[list[Result]] = [[] for _ in plan]
    calibrations: dict[tuple[CostSet, int], list[Calibration]] = {}
    for rep in range(args.repeats):
        for i, (costs, case) in enumerate(plan):
            args.forward_ms, args.backward_ms, args.wgrad_ms = costs.t_f, costs.t_b, costs.t_w
            if case.note == CALIBRATION_NOTE:
                r, cal = run_calibration(case.stages, costs.op_costs(), args, workdir)
                print(f"#   [{rep + 1}/{args.repeats}] {costs.label} calibration N={case.stages}: "
                      f"{r.error or describe(cal)}  [run {r.run_wall_s:.0f}s, load {r.load_after:.1f}]",  # type: ignore[arg-type]
                      file=sys.stderr, flush=True)
                if cal is not None:
                    calibrations.setdefault((costs, case.stages), []).append(cal)
                continue
            r = run_case(case, args, workdir)
            print(f"#   [{rep + 1}/{args.repeats}] {costs.label} {case.schedule:>6} N={case.stages} m={case.microbatches}: "
                  f"{r.error or f'{r.measured_ms:.1f} ms/iter'}  [run {r.run_wall_s:.0f}s, load {r.load_after:.1f}]",
                  file=sys.stderr, flush=True)
            runs[i].append(r)
    best = [best_of(rs) if rs else None for rs in runs]

    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for costs in args.costs:
        mine = [(case, r) for (c, case), r in zip(plan, best) if c == costs and r is not None]
        baselines = {case.microbatches: r for case, r in mine if case.stages == 1 and not r.error}
        for n in args.stages:
            group = [r for case, r in mine if case.stages == n]
            t_comm = least_loaded_t_comm([r for r in group if not r.error])
            cals = calibrations.get((costs, n))
            cal = median_calibration(cals) if cals else None
            if cal is not None:
                notes.append(f"# costs {costs.label}, N={n}: calibrated (median of {len(cals)}) {describe(cal)}")
            for m in sorted({r.microbatches for r in group}):
                base = baselines.get(m)
                per_op = per_op_overhead(base) if base else 0.0
                notes.append(f"# costs {costs.label}, N={n}, m={m}: per-op overhead o = {per_op:.2f} ms "
                             f"(N=1 baseline {base.measured_ms if base else float('nan'):.1f} ms vs sleeps "
                             f"{base.ideal_ms if base else float('nan'):.0f} ms), T_comm = {t_comm:.3f} ms (profiled)")
                ovh = RuntimeTerms(per_op=per_op, t_comm=t_comm)
                calibrated = None if cal is None else cal.terms(
                    cal.per_op_at_depth if args.calibrated_per_op == "depth" else per_op)
                cell = [r for r in group if r.microbatches == m]
                ref = next((r for r in cell if r.schedule == "1f1b" and not r.error), None)
                ref_sim = predict(ref, costs, ovh, None)["sim_ms"] if ref else float("nan")
                for r in cell:
                    row: dict[str, Any] = {"costs": costs.label, "N": n, "m": m, "schedule": r.schedule,
                                           "error": r.error, "result": asdict(r), "per_op_ms": per_op, "t_comm_ms": t_comm,
                                           "calibration": asdict(cal) if cal is not None else None}
                    if not r.error:
                        row.update(predict(r, costs, ovh, calibrated))
                        row.update(measured_ms=r.measured_ms, repeats_ms=r.repeat_measured_ms, load1=r.load_after,
                                   measured_bubble_rate=1.0 - r.ideal_ms / r.measured_ms,
                                   speedup_measured=(ref.measured_ms / r.measured_ms) if ref else float("nan"),
                                   speedup_sim=ref_sim / row["sim_ms"])
                    rows.append(row)
    print()
    print(table(rows))
    print()
    for line in notes:
        print(line)
    loads = [x for rs in runs for r in rs if not r.error for x in (r.load_before, r.load_after)]
    if loads:
        print(f"# 1-minute load average around the runs: {min(loads):.1f} .. {max(loads):.1f} on {os.cpu_count()} cores")
    print(f"# total wall time {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": {k: v for k, v in vars(args).items() if k != "costs"} |
                                               {"costs": [c.label for c in args.costs]}, "rows": rows}, indent=2))
    if workdir_ctx is not None:
        workdir_ctx.cleanup()
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
