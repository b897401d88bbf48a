"""What each piece of a rank's instrumentation costs, off and on, in CPU time per op.

Issue 18 asks that instrumentation which is off costs nothing and instrumentation which is on
costs at most 3 %. This runs the same small training through the real trainer and the
distributed executor (one rank, world size 1, in this process) once per variant:

* ``off``: no instrumentation flag (what the speed benchmarks run);
* ``meter``: ``--log-activation-memory`` (saved-tensor hooks count every saved tensor's bytes);
* ``trace``: ``--trace-dir`` (every op's span recorded and written);
* ``params-norm``: ``--log-params-norm`` (a report carries the parameters' sum of squares);
* ``drift``: ``--log-weight-version-drift`` (the drift bookkeeping itself always runs: it is
  what the reports carry; the flag only prints it);
* ``all``: every flag above at once.

Measure: the rank's main-thread CPU time (``time.thread_time``) between consecutive log
records (``--log-interval 1``: one iteration each, statistics report and optimizer step
included), divided by the iteration's compute ops (F and BW), of the cheapest iteration after
the first two. CPU time, not wall time, so other processes' running time does not enter the
number; and the cheapest iteration, because what a loaded host still adds to CPU time (caches
and cores shared with other work) only ever adds. The variants run interleaved, ``--rounds`` times, and the on/off ratio is formed per
round (the median and min-max over rounds are printed). Every run is a fresh process (a
megatron-core process keeps its parallel state), which times itself and prints the result.

Workloads: ``synthetic`` (the synthetic-cost stage with zero sleeps, so only the runtime's
own work is left: ``megatron/trainer/tasks/synthetic.py``) and ``gpt`` (one stage of the speed
issue's workload, ``benchmarks/peer_pipelining.py``'s ``WORKLOAD`` with the layers of one of its
two stages; ``--quick``: its tiny model).

    python benchmarks/instrumentation_overhead.py                  # both workloads, ~4 min
    python benchmarks/instrumentation_overhead.py --workloads synthetic --rounds 5
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.peer_pipelining import QUICK, WORKLOAD  # noqa: E402

VARIANTS: dict[str, tuple[str, ...]] = {
    "off": (),
    "meter": ("--log-activation-memory",),
    "trace": ("--trace-dir", "{trace}"),
    "params-norm": ("--log-params-norm",),
    "drift": ("--log-weight-version-drift",),
    "all": ("--log-activation-memory", "--trace-dir", "{trace}", "--log-params-norm", "--log-weight-version-drift"),
}
SKIPPED_ITERATIONS = 2  # first-touch allocations and lazy imports land in the first iterations


def workload_argv(name: str, quick: bool, iters: int) -> tuple[list[str], int]:
    """Trainer flags of a workload and its compute ops per iteration."""
    common = ["--pipeline-model-parallel-size", "1", "--device", "cpu", "--num-threads", "1",
              "--train-iters", str(iters), "--log-interval", "1", "--lr", "1e-4", "--lr-decay-style", "constant"]
    if name == "synthetic":
        m = 16
        return [*common, "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "1",
                "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", str(m),
                "--synthetic-forward-ms", "0", "--synthetic-backward-ms", "0"], 2 * m
    w = QUICK if quick else {**WORKLOAD, "num_layers": WORKLOAD["num_layers"] // 2}  # one of its 2 stages
    m = 4
    return [*common, "--num-layers", str(w["num_layers"]), "--hidden-size", str(w["hidden"]),
            "--num-attention-heads", str(w["heads"]), "--seq-length", str(w["seq"]), "--vocab-size", str(w["vocab"]),
            "--micro-batch-size", str(w["mbs"]), "--global-batch-size", str(w["mbs"] * m), "--mock-data",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--clip-grad", "1.0"], 2 * m


@contextlib.contextmanager
def cpu_marks() -> Iterator[list[float]]:
    """Main-thread CPU time at every log record of the runs inside the block."""
    from megatron.trainer.loop.logger import TrainingLogger

    marks: list[float] = []
    original = TrainingLogger.log_update

    def log_update(self: TrainingLogger, update: int, reports: list) -> None:
        marks.append(time.thread_time())
        original(self, update, reports)

    TrainingLogger.log_update = log_update  # type: ignore[method-assign]
    try:
        yield marks
    finally:
        TrainingLogger.log_update = original  # type: ignore[method-assign]


def task_of(workload: str):
    if workload == "synthetic":
        from megatron.trainer.tasks.synthetic import SyntheticCostTask

        return SyntheticCostTask()
    from megatron.trainer.tasks.gpt import GPTTask

    return GPTTask()


def cpu_ms_per_op(workload: str, variant: str, quick: bool, iters: int, tmp: Path) -> float:
    """Main-thread CPU ms per compute op of one run's cheapest iteration (see the module docstring)."""
    from megatron.trainer.loop.training import pretrain

    argv, ops = workload_argv(workload, quick, iters)
    trace = str(tmp / f"trace-{workload}-{variant}")
    argv += [a.replace("{trace}", trace) for a in VARIANTS[variant]]
    with cpu_marks() as marks, contextlib.redirect_stdout(io.StringIO()):
        code = pretrain(task_of(workload), argv, script=__file__)
    if code != 0 or len(marks) != iters:
        raise RuntimeError(f"{workload}/{variant}: exit {code}, {len(marks)} of {iters} log records")
    per_iteration = [b - a for a, b in zip(marks[SKIPPED_ITERATIONS:], marks[SKIPPED_ITERATIONS + 1:])]
    return 1000.0 * min(per_iteration) / ops


def run_child(workload: str, variant: str, quick: bool, iters: int, tmp: Path) -> float:
    """One run in a fresh process (see the module docstring); its CPU ms per op."""
    cmd = [sys.executable, __file__, "--child", workload, variant, "--child-iters", str(iters), "--child-tmp", str(tmp),
           *(["--quick"] if quick else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{workload}/{variant} failed:\n{proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    p.add_argument("--child-iters", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-tmp", help=argparse.SUPPRESS)
    p.add_argument("--workloads", nargs="+", choices=("synthetic", "gpt"), default=["synthetic", "gpt"])
    p.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the variants")
    p.add_argument("--synthetic-iters", type=int, default=60)
    p.add_argument("--gpt-iters", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="the tiny GPT instead of the speed workload's stage")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.child:  # one timed run in this process: print its CPU ms per op
        print(cpu_ms_per_op(a.child[0], a.child[1], a.quick, a.child_iters, Path(a.child_tmp)))
        return 0
    if "off" not in a.variants:
        p.error("--variants must include off: the ratios are against it")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load = lambda: " ".join(Path("/proc/loadavg").read_text().split()[:3])  # noqa: E731
    print(f"# load average before: {load()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="instrumentation-") as tmp:
        for workload in a.workloads:
            iters = a.synthetic_iters if workload == "synthetic" else a.gpt_iters
            runs: dict[str, list[float]] = {v: [] for v in a.variants}
            for r in range(a.rounds):
                for variant in a.variants:
                    runs[variant].append(run_child(workload, variant, a.quick, iters, Path(tmp)))
                print(f"# {workload} round {r + 1}: " + ", ".join(f"{v} {runs[v][-1]:.4f}" for v in a.variants), flush=True)
            for variant in a.variants:
                ratios = [on / off for on, off in zip(runs[variant], runs["off"])]
                rows.append({"workload": workload, "variant": variant, "flags": " ".join(VARIANTS[variant]),
                             "cpu_ms_per_op": statistics.median(runs[variant]), "runs_ms": runs[variant],
                             "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)})
    print(f"\n{a.rounds} interleaved rounds; load average after: {load()}\n")
    print("| workload | instrumentation | flags | CPU ms per op (median) | on / off (median, min-max) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['variant']} | {r['flags'].replace('{trace}', 'DIR') or '-'} | "
              f"{r['cpu_ms_per_op']:.4f} | {r['ratio_median']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
