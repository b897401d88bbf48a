"""Schedule efficiency through the real distributed runtime, on the synthetic-cost model.

Every stage's forward sleeps ``t_f`` and its backward ``t_b`` (plus ``t_w`` for the weight gradient with
``--wgrad-ms``; ``megatron/trainer/tasks/synthetic.py``: sleeps stand in for compute on purpose), so N ranks on a 2-core machine behave like N devices
with known op costs. For each (schedule, N, m) this launches ``benchmarks/harness/synthetic_stage_run.py``
(one gloo process per stage, one torch thread each), reads its ``--log-json`` records and compares
the measured steady-state time per iteration with

* the bubble-free ideal ``m * (t_f + t_b + t_w)``, and
* the analytic time of the schedule: ``(m + N - 1) * (t_f + t_b + t_w)`` for 1F1B and GPipe (flush every
  iteration), the ideal itself for the asynchronous schedules (no flush: no bubble in steady state).
  Zero Bubble schedules have no closed form here; ``benchmarks/zero_bubble_synthetic.py`` compares
  them with the timing simulator instead, reusing this module's runner.

Efficiency is ``ideal / time``; measured and analytic efficiency sit side by side in one table.
``overhead/slot`` spreads the measured excess over the schedule's time slots
(``(measured - analytic) / (m + N - 1)``, or ``/ m`` when asynchronous): roughly the runtime's cost
per forward+backward pair, communication included. An N = 1 baseline row (no communication)
gives the cost per op of the runtime itself.

    python benchmarks/schedule_efficiency.py                 # N = 4, 8; m = N/2, N, 2N (~10 min)
    python benchmarks/schedule_efficiency.py --quick         # a ~2 minute subset
    python benchmarks/schedule_efficiency.py --stages 4 --microbatches 4 8 --schedules 1f1b --json out.json

Timing: iterations are timed on the logging rank (stage 0) between log records. The first
``--warmup-intervals`` logged intervals (process start-up, pipeline fill) are skipped, and for an
asynchronous schedule the last one too (the final drain). ``measured`` is the median over the
remaining intervals of their time per iteration (a shared machine's load spikes hit single
intervals); ``mean`` is the whole window's time per iteration; ``spread`` is max - min. With
``--repeats R`` the whole sweep runs R times and each case reports its fastest repeat (other work
on the machine only ever adds time; every repeat's median is listed too).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from megatron.pipeline.schedules import SCHEDULES, ScheduleConfig, ScheduleConfigError  # noqa: E402
from benchmarks.harness.wake_probe import linear_costs  # noqa: E402

RUN_SCRIPT = REPO / "benchmarks" / "harness" / "synthetic_stage_run.py"
DEFAULT_SCHEDULES = ("1f1b", "gpipe")
OPTIONAL_SCHEDULES = ("paci", "async-1f1b")  # added by default when registered
# Synchronous schedules whose iteration time is (m + N - 1)(t_f + t_b); for any other synchronous
# schedule (interleaved, Zero Bubble, ...) the harness has no analytic value and prints nan.
FLUSH_SCHEDULES = ("1f1b", "gpipe")
# The trainer's log line with the order a profiled zb-1p / zb-2p run decided (megatron.pipeline.runtime.profiling).
ZB_CHOICE_MARKER = "zero-bubble-schedule "
# Environment variables that would make the launched script think it is a rank already.
_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "MEGATRON_ASYNC_LAUNCHED")


@dataclass
class Case:
    schedule: str
    stages: int
    microbatches: int
    iterations: int
    log_interval: int
    note: str = ""
    extra_args: tuple[str, ...] = ()  # more trainer flags (e.g. --pipemare-discrepancy-decay 0.1)


@dataclass
class Result:
    schedule: str
    stages: int
    microbatches: int
    asynchronous: bool
    forward_ms: float
    backward_ms: float
    iterations: int
    log_interval: int
    timed_iterations: int = 0
    ideal_ms: float = 0.0
    analytic_ms: float = 0.0
    measured_ms: float = float("nan")  # median over the timed log intervals (robust to load spikes)
    mean_ms: float = float("nan")  # total time of the timed window / its iterations
    interval_ms: list[float] = field(default_factory=list)  # per timed log interval, per iteration
    measured_efficiency: float = float("nan")
    analytic_efficiency: float = float("nan")
    overhead_per_slot_ms: float = float("nan")
    run_wall_s: float = 0.0
    load_before: float = 0.0
    load_after: float = 0.0
    cpu_pressure_before: float | None = None  # Linux PSI "some avg10": % of time tasks waited for a CPU
    cpu_pressure_after: float | None = None
    waited_for_load_s: float = 0.0
    repeat_measured_ms: list[float] = field(default_factory=list)  # every repeat's median, in run order
    note: str = ""
    error: str | None = None
    wgrad_ms: float = 0.0  # t_w: weight-gradient sleep (op W of a B/W split, inside a fused BW)
    # zb-1p / zb-2p: what the run logged after profiling (costs, memory limit), i.e. the order it ran
    zb_choice: dict[str, Any] | None = None
    # per stage, the maximum over all log records (whole run): peak_inflight_microbatches,
    # peak_activation_mb, drift_max (the runtime's own accounting)
    stage_max: dict[str, list[float]] = field(default_factory=dict)

    @property
    def slots(self) -> int:
        return self.microbatches if self.asynchronous or self.stages == 1 else self.microbatches + self.stages - 1


def is_asynchronous(schedule: str) -> bool:
    return SCHEDULES[schedule].traits.asynchronous


def config_error(schedule: str, stages: int, microbatches: int, iterations: int) -> str | None:
    try:
        SCHEDULES[schedule].check_config(ScheduleConfig(stages, microbatches, iterations))
    except ScheduleConfigError as exc:
        return str(exc)
    return None


def plan_cases(args: argparse.Namespace) -> tuple[list[Case], list[Result]]:
    """The runs to make, and (as results with an error) the combinations that cannot run."""
    cases: list[Case] = []
    skipped: list[Result] = []
    for schedule in args.schedules:
        for n in args.stages:
            ms = args.microbatches or ([n] if args.quick else sorted({max(1, n // 2), n, 2 * n}))
            valid = [m for m in ms if config_error(schedule, n, m, args.iterations) is None]
            for m in valid:
                cases.append(Case(schedule, n, m, args.iterations, args.log_interval))
            if not valid and config_error(schedule, n, 1, args.iterations) is None:
                # e.g. async-1f1b: one micro-batch per update. Keep the number of micro-batches
                # per run and per log interval comparable with the other rows.
                k = max(1, n)
                cases.append(Case(schedule, n, 1, args.iterations * k, args.log_interval * k,
                                  note=f"m={','.join(map(str, ms))} rejected; ran m=1 (update per micro-batch)"))
                continue
            for m in ms:
                if m not in valid:
                    skipped.append(Result(schedule, n, m, is_asynchronous(schedule), args.forward_ms,
                                          args.backward_ms, args.iterations, args.log_interval,
                                          error=f"not run: {config_error(schedule, n, m, args.iterations)}"))
    if args.baseline:
        for m in sorted(set(args.baseline_microbatches or ([4] if args.quick else [4, 16]))):
            cases.append(Case("1f1b", 1, m, args.iterations, args.log_interval, note="baseline: no communication"))
    return cases, skipped


def run_argv(case: Case, args: argparse.Namespace) -> list[str]:
    """``synthetic_stage_run.py``'s flags for ``case`` (``--log-json`` aside)."""
    t_f, t_b, t_w = args.forward_ms, args.backward_ms, getattr(args, "wgrad_ms", 0.0)
    return [
        "--pipeline-model-parallel-size", str(case.stages), "--num-layers", str(case.stages),
        "--pipeline-schedule", case.schedule,
        "--micro-batch-size", "1", "--global-batch-size", str(case.microbatches),
        "--seq-length", str(args.seq_length), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", "1",
        "--train-iters", str(case.iterations), "--log-interval", str(case.log_interval),
        "--synthetic-forward-ms", str(t_f), "--synthetic-backward-ms", str(t_b), "--synthetic-wgrad-ms", str(t_w),
        "--device", "cpu", "--distributed-backend", "gloo", "--num-threads", "1",
        "--lr-warmup-iters", "0", *case.extra_args,
    ]


def run_case(case: Case, args: argparse.Namespace, workdir: Path) -> Result:
    t_f, t_b, t_w = args.forward_ms, args.backward_ms, getattr(args, "wgrad_ms", 0.0)
    res = Result(case.schedule, case.stages, case.microbatches, is_asynchronous(case.schedule), t_f, t_b,
                 case.iterations, case.log_interval, note=case.note, wgrad_ms=t_w)
    res.ideal_ms = case.microbatches * (t_f + t_b + t_w)
    known = res.asynchronous or case.stages == 1 or case.schedule in FLUSH_SCHEDULES
    res.analytic_ms = res.slots * (t_f + t_b + t_w) if known else float("nan")
    res.analytic_efficiency = res.ideal_ms / res.analytic_ms
    log = workdir / f"{case.schedule}-N{case.stages}-m{case.microbatches}.jsonl"
    log.unlink(missing_ok=True)
    cmd = [sys.executable, str(RUN_SCRIPT), *run_argv(case, args), "--log-json", str(log)]
    if getattr(args, "nice", 0):
        cmd = ["nice", "-n", str(args.nice), *cmd]  # the ranks inherit it
    env = {k: v for k, v in os.environ.items() if k not in _RANK_ENV}
    env.setdefault("PYTHONWARNINGS", "ignore")
    res.waited_for_load_s = wait_for_quiet(args.max_load, args.max_wait)
    res.load_before, res.cpu_pressure_before = os.getloadavg()[0], cpu_pressure()
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        res.error = f"timed out after {args.run_timeout:.0f}s"
        return res
    finally:
        res.run_wall_s = time.perf_counter() - start
        res.load_after, res.cpu_pressure_after = os.getloadavg()[0], cpu_pressure()
    if args.verbose:
        sys.stderr.write(proc.stdout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        res.error = f"exit {proc.returncode}: {' / '.join(tail)}"
        return res
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    records.sort(key=lambda r: r["iteration"])
    res.stage_max = {key: [max(r[key][s] for r in with_key) for s in range(case.stages)]
                     for key in STAGE_KEYS if (with_key := [r for r in records if key in r])}
    res.zb_choice = next((json.loads(line.split(ZB_CHOICE_MARKER, 1)[1])
                          for line in proc.stdout.splitlines() if ZB_CHOICE_MARKER in line), None)
    return measure(res, records, args.warmup_intervals)


STAGE_KEYS = ("peak_inflight_microbatches", "peak_activation_mb", "drift_max")


def measure(res: Result, records: list[dict[str, Any]], warmup_intervals: int) -> Result:
    """Steady-state time per iteration from ``--log-json`` records (see the module docstring)."""
    end = len(records) - 1 - (1 if res.asynchronous else 0)
    first = warmup_intervals - 1  # the record that closes the last skipped interval
    if first < 0 or end <= first:
        res.error = (f"{len(records)} log records leave no interval to time after skipping "
                     f"{warmup_intervals}; raise --iterations or lower --log-interval")
        return res
    window = records[first:end + 1]
    iters = window[-1]["iteration"] - window[0]["iteration"]
    res.timed_iterations = iters
    res.mean_ms = 1000.0 * (window[-1]["elapsed_s"] - window[0]["elapsed_s"]) / iters
    res.interval_ms = [
        1000.0 * (b["elapsed_s"] - a["elapsed_s"]) / (b["iteration"] - a["iteration"])
        for a, b in zip(window, window[1:])
    ]
    res.measured_ms = statistics.median(res.interval_ms)
    res.measured_efficiency = res.ideal_ms / res.measured_ms
    res.overhead_per_slot_ms = (res.measured_ms - res.analytic_ms) / res.slots
    return res


def best_of(repeats: list[Result]) -> Result:
    """The repeat with the smallest measured time (noise from other work only ever adds time)."""
    ok = [r for r in repeats if not r.error]
    best = min(ok, key=lambda r: r.measured_ms) if ok else repeats[-1]
    best.repeat_measured_ms = [r.measured_ms for r in ok]
    return best


def cpu_pressure() -> float | None:
    """Linux PSI: % of the last 10 s in which some runnable task waited for a CPU (None if unknown)."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(line.split("avg10=")[1].split()[0])
    except (OSError, IndexError, ValueError):
        return None


def wait_for_quiet(max_load: float | None, max_wait: float) -> float:
    """Wait (at most ``max_wait`` s) until the 1-minute load average is below ``max_load``."""
    if max_load is None:
        return 0.0
    start = time.perf_counter()
    while os.getloadavg()[0] >= max_load and time.perf_counter() - start < max_wait:
        time.sleep(5.0)
    return time.perf_counter() - start


def sleep_overshoot_ms(seconds: float, repeats: int = 20) -> float:
    """Mean amount by which ``time.sleep(seconds)`` oversleeps in this process, right now."""
    total = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        time.sleep(seconds)
        total += time.perf_counter() - t0 - seconds
    return 1000.0 * total / repeats


def host_wake_note(seconds: float, overshoot_ms: float | None = None) -> str:
    """The header's line on what waking costs here: the sleep's overshoot, and the synthetic
    stage's own work back to back vs right after such a sleep (``benchmarks/investigations/wake_cost.py``).
    Every synthetic op runs on a freshly woken core, so the runtime's per-op cost measured by
    these benchmarks is read against this host's after-sleep factor."""
    overshoot_ms = sleep_overshoot_ms(seconds) if overshoot_ms is None else overshoot_ms
    warm, after = linear_costs([0.0, seconds], repeats=30)
    return (f"time.sleep({1000 * seconds:g} ms) oversleeps {overshoot_ms:.2f} ms here; a tiny "
            f"linear F+B takes {warm:.0f} us back to back, {after:.0f} us right after that sleep")


COLUMNS = ["schedule", "N", "m", "ideal m(tf+tb) ms", "analytic ms", "measured ms", "mean ms", "spread ms",
           "measured eff", "analytic eff", "measured/analytic", "overhead/slot ms", "load1", "all repeats ms"]


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    """A markdown table; a short row (an error) is padded with empty cells."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cells + [""] * (len(columns) - len(cells))) + " |" for cells in rows]
    return "\n".join(lines)


def table(results: list[Result]) -> str:
    rows = []
    for r in results:
        name = r.schedule + (" (async)" if r.asynchronous else "") + (" [N=1 baseline]" if r.stages == 1 else "")
        if r.error:
            cells = [name, str(r.stages), str(r.microbatches), "", "", r.error.replace("|", "/")]
        else:
            spread = max(r.interval_ms) - min(r.interval_ms) if len(r.interval_ms) > 1 else 0.0
            cells = [
                name, str(r.stages), str(r.microbatches), f"{r.ideal_ms:.0f}", f"{r.analytic_ms:.0f}",
                f"{r.measured_ms:.1f}", f"{r.mean_ms:.1f}", f"{spread:.1f}", f"{r.measured_efficiency:.3f}",
                f"{r.analytic_efficiency:.3f}", f"{r.measured_ms / r.analytic_ms:.3f}",
                f"{r.overhead_per_slot_ms:.2f}", f"{r.load_after:.1f}",
                " / ".join(f"{x:.1f}" for x in r.repeat_measured_ms),
            ]
        rows.append(cells)
    return markdown_table(COLUMNS, rows)


def overhead_fit(results: list[Result]) -> list[dict[str, Any]]:
    """Per (schedule, N) with >= 2 values of m: least squares ``measured - analytic = a * slots + c``.

    ``a`` is the runtime's cost per forward+backward slot, ``c`` its fixed cost per iteration
    (optimizer step with the pipeline-wide norm all-gather, statistics side channel).
    """
    fits = []
    groups: dict[tuple[str, int], list[Result]] = {}
    for r in results:
        if not r.error and r.stages > 1 and r.analytic_ms == r.analytic_ms:  # skip nan (no analytic model)
            groups.setdefault((r.schedule, r.stages), []).append(r)
    for (schedule, n), rs in sorted(groups.items()):
        xs = [float(r.slots) for r in rs]
        if len(set(xs)) < 2:
            continue
        ys = [r.measured_ms - r.analytic_ms for r in rs]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        fits.append({"schedule": schedule, "stages": n, "per_slot_ms": a, "per_iteration_ms": my - a * mx})
    return fits


def baseline_fit(base: list[Result]) -> dict[str, float] | None:
    """N=1 rows with two or more m: ``measured - ideal = per_op * 2m + per_iteration``."""
    pts = {r.microbatches: r.measured_ms - r.ideal_ms for r in base}
    if len(pts) < 2:
        return None
    xs, ys = [2.0 * m for m in pts], list(pts.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"per_op_ms": a, "per_iteration_ms": my - a * mx}


def parse_table(text: str) -> list[dict[str, str]]:
    """Rows of the first markdown table in ``text`` (used by the tests)."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    if len(rows) < 2:
        return []
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in row.strip("|").split("|")))) for row in rows[2:]]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--stages", type=int, nargs="+", default=[4, 8], help="pipeline depths N")
    p.add_argument("--microbatches", type=int, nargs="+", default=None,
                   help="micro-batches per iteration m (default per N: N/2, N, 2N)")
    p.add_argument("--schedules", nargs="+", default=None,
                   help=f"default: {' '.join(DEFAULT_SCHEDULES)} plus {' '.join(OPTIONAL_SCHEDULES)} when registered")
    p.add_argument("--forward-ms", type=float, default=20.0, help="t_f: sleep of one stage forward")
    p.add_argument("--backward-ms", type=float, default=40.0, help="t_b: sleep of one stage backward")
    p.add_argument("--wgrad-ms", type=float, default=0.0,
                   help="t_w: sleep of one stage weight gradient (op W of a B/W split; a fused backward sleeps t_b + t_w)")
    p.add_argument("--iterations", type=int, default=12, help="optimizer steps per run (--train-iters)")
    p.add_argument("--log-interval", type=int, default=2)
    p.add_argument("--warmup-intervals", type=int, default=1, help="logged intervals skipped as warm-up")
    p.add_argument("--repeats", type=int, default=1,
                   help="sweep everything this many times and report each case's fastest repeat")
    p.add_argument("--seq-length", type=int, default=8, help="activation [s, b=1, h] sent between stages")
    p.add_argument("--hidden-size", type=int, default=16)
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="also run N=1 (no communication) to measure the runtime's cost per op")
    p.add_argument("--baseline-microbatches", type=int, nargs="+", default=None,
                   help="m of the N=1 baseline runs (default 4 16; --quick: 4)")
    p.add_argument("--quick", action="store_true",
                   help="~2 minutes: N=4, 8 with m=N, 1f1b and gpipe, 8 iterations, one N=1 baseline")
    p.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON")
    p.add_argument("--workdir", default=None, help="where run logs go (default: a temporary directory)")
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds before one run is abandoned")
    p.add_argument("--max-load", type=float, default=None,
                   help="shared machine: before each run wait until the 1-minute load average is below this")
    p.add_argument("--max-wait", type=float, default=300.0, help="longest wait for --max-load (seconds)")
    p.add_argument("--nice", type=int, default=0,
                   help="run the ranks at this niceness (e.g. -10 as root on a shared host: the ranks mostly "
                        "sleep, so they take little CPU from others, but their wake-ups no longer queue behind "
                        "other work; 0: unchanged)")
    p.add_argument("--verbose", action="store_true", help="echo each run's training log to stderr")
    p.add_argument("--combine", nargs="+", default=None, metavar="JSON",
                   help="run nothing: merge earlier --json outputs (same t_f, t_b) into one best-of table "
                        "(--schedules filters its rows)")
    return p


def combine(paths: list[str], schedules: list[str] | None = None) -> int:
    """Best-of table over several sweeps' ``--json`` files (e.g. made at different times of day)."""
    by_case: dict[tuple[str, int, int], list[Result]] = {}
    settings = set()
    for path in paths:
        payload = json.loads(Path(path).read_text())
        settings.add((payload["forward_ms"], payload["backward_ms"], payload.get("wgrad_ms", 0.0),
                      payload["iterations"], payload["log_interval"]))
        for d in payload["results"]:
            d = {k: v for k, v in d.items() if k in Result.__dataclass_fields__}
            repeats = d.pop("repeat_measured_ms", None) or []
            r = Result(**d)
            if r.error or (schedules and r.schedule not in schedules and r.stages > 1):
                continue
            # every repeat of that sweep counts as one run; the stored row is its fastest
            for x in repeats or [r.measured_ms]:
                by_case.setdefault((r.schedule, r.stages, r.microbatches), []).append(
                    r if x == r.measured_ms else Result(**{**asdict(r), "measured_ms": x}))
    if len(settings) != 1:
        print(f"error: the files differ in (t_f, t_b, t_w, iterations, log interval): {sorted(settings)}", file=sys.stderr)
        return 2
    results = []
    for runs in by_case.values():
        best = min(runs, key=lambda r: r.measured_ms)
        best.repeat_measured_ms = [r.measured_ms for r in runs]
        results.append(best)
    order = {name: i for i, name in enumerate(DEFAULT_SCHEDULES + OPTIONAL_SCHEDULES)}
    results.sort(key=lambda r: (r.stages == 1, order.get(r.schedule, len(order)), r.schedule, r.stages, r.microbatches))
    t_f, t_b, t_w, iters, interval = settings.pop()
    print(f"# best of {len(paths)} sweep file(s): t_f={t_f:g} ms, t_b={t_b:g} ms, t_w={t_w:g} ms, {iters} iterations, "
          f"log interval {interval}")
    print()
    print(table(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.combine:
        return combine(args.combine, args.schedules)
    if args.quick:  # explicit --schedules / --microbatches still win
        args.schedules = args.schedules or list(DEFAULT_SCHEDULES)
        args.iterations = min(args.iterations, 8)
    if args.schedules is None:
        args.schedules = list(DEFAULT_SCHEDULES) + [s for s in OPTIONAL_SCHEDULES if s in SCHEDULES]
    unknown = [s for s in args.schedules if s not in SCHEDULES]
    if unknown:
        print(f"error: unknown schedule(s) {unknown}; registered: {sorted(SCHEDULES)}", file=sys.stderr)
        return 2
    cases, skipped = plan_cases(args)

    workdir_ctx = tempfile.TemporaryDirectory(prefix="schedule-efficiency-") if args.workdir is None else None
    workdir = Path(args.workdir or workdir_ctx.name)  # type: ignore[union-attr]
    workdir.mkdir(parents=True, exist_ok=True)
    overshoot = sleep_overshoot_ms(args.forward_ms / 1000.0)
    wake = host_wake_note(args.forward_ms / 1000.0, overshoot)
    cores = os.cpu_count()
    print(f"# synthetic-cost schedule efficiency: t_f={args.forward_ms:g} ms, t_b={args.backward_ms:g} ms, "
          f"{args.iterations} iterations, log interval {args.log_interval}, "
          f"{args.warmup_intervals} warm-up interval(s) skipped, best of {args.repeats} repeat(s)", flush=True)
    print(f"# machine: {cores} CPU cores, gloo, 1 torch thread per rank; load average {os.getloadavg()[0]:.1f}; "
          f"{wake}", flush=True)
    t0 = time.perf_counter()
    runs: list[list[Result]] = [[] for _ in cases]
    for rep in range(args.repeats):  # whole sweeps, so a burst of load hits different cases each time
        for i, case in enumerate(cases):
            r = run_case(case, args, workdir)
            status = r.error or (f"measured {r.measured_ms:.1f} ms/iter vs analytic {r.analytic_ms:.0f} "
                                 f"(eff {r.measured_efficiency:.3f} vs {r.analytic_efficiency:.3f})")
            print(f"#   [{rep + 1}/{args.repeats}] {case.schedule:>10} N={case.stages} m={case.microbatches}: "
                  f"{status}  [run {r.run_wall_s:.0f}s, load {r.load_after:.1f}]", file=sys.stderr, flush=True)
            runs[i].append(r)
    results = [best_of(rs) for rs in runs]
    order = {name: i for i, name in enumerate(args.schedules)}
    results = sorted(results + skipped,
                     key=lambda r: (r.stages == 1, order.get(r.schedule, -1), r.stages, r.microbatches))
    total = time.perf_counter() - t0
    print()
    print(table(results))
    print()
    fits = overhead_fit(results)
    for f in fits:
        print(f"# overhead fit {f['schedule']} N={f['stages']}: {f['per_slot_ms']:.2f} ms per slot "
              f"+ {f['per_iteration_ms']:.1f} ms per iteration")
    for r in results:
        if r.note and not r.error and r.stages > 1:
            print(f"# note {r.schedule} N={r.stages}: {r.note}")
    base = [r for r in results if r.stages == 1 and not r.error]
    for r in base:
        per_op = (r.measured_ms - r.ideal_ms) / (2 * r.microbatches)
        print(f"# N=1 baseline (m={r.microbatches}): measured/ideal - 1 = {r.measured_ms / r.ideal_ms - 1:.4f}, "
              f"i.e. {per_op:.2f} ms per op (forward or backward), optimizer step spread over the ops")
    fit = baseline_fit(base)
    if fit is not None:
        print(f"# N=1 baseline fit: {fit['per_op_ms']:.2f} ms per op + {fit['per_iteration_ms']:.2f} ms per "
              f"iteration (optimizer step, logging)")
    loads = [x for r in results if not r.error for x in (r.load_before, r.load_after)]
    if loads:
        print(f"# 1-minute load average around the runs: {min(loads):.1f} .. {max(loads):.1f} "
              f"on {cores} cores (other work on the machine delays every wake-up)")
    print(f"# total wall time {total:.0f} s")
    if args.json:
        payload = {
            "forward_ms": args.forward_ms, "backward_ms": args.backward_ms, "wgrad_ms": args.wgrad_ms,
            "iterations": args.iterations,
            "log_interval": args.log_interval, "warmup_intervals": args.warmup_intervals, "repeats": args.repeats,
            "cpu_count": cores, "sleep_overshoot_ms": overshoot, "host_wake": wake, "total_wall_s": total,
            "results": [asdict(r) | {"slots": r.slots} for r in results], "overhead_fits": fits,
            "baseline_fit": baseline_fit([r for r in results if r.stages == 1 and not r.error]),
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
    if workdir_ctx is not None:
        workdir_ctx.cleanup()
    return 1 if any(r.error and not r.error.startswith("not run") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
