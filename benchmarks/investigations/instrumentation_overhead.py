"""What each piece of a rank's instrumentation costs, off and on, in CPU time per op.

Issue 18 asks that instrumentation which is off costs nothing and instrumentation which is on
costs at most 3 %. Variants:

* ``off``: no instrumentation flag (what the speed benchmarks run);
* ``meter``: ``--log-activation-memory`` (saved-tensor hooks count every saved tensor's bytes);
* ``trace``: ``--trace-dir`` (every op's span recorded);
* ``params-norm``: ``--log-params-norm`` (a report carries the parameters' sum of squares);
* ``all``: every flag above at once.
(The drift bookkeeping has no switch: one list append and one counter increment per backward,
which the reports carry; ``--log-weight-version-drift`` only prints it. The end-to-end mode
times that flag too.)

**Paired mode (default).** One stage worker is built by the trainer (``emulate`` of one
iteration, which is also the warm-up, N = 1, one thread), then iterations run on it directly
(``run_compute_op`` for every F and BW, the optimizer step and the statistics report, as an
executor runs them), each variant switched on the worker as its flag does
(``StageSetup.measure_activations`` -> the meter's ``measure_bytes``, the tracer the trainer
attaches, ``report_params_norm``). The variants take turns iteration by iteration, so a pair
is milliseconds apart and sees the same load; the measure is the main thread's CPU time
(``time.thread_time``) per compute op, and the on/off ratio is formed per round (median and
min-max over ``--rounds`` rounds).

**End-to-end mode** (``--end-to-end``): every variant is a whole trainer run with the flag, in
a fresh process (a megatron-core process keeps its parallel state), through the distributed
executor (world size 1); the measure is the CPU time between consecutive log records
(``--log-interval 1``) over the iteration's compute ops, the cheapest iteration after the first
two (what a loaded host adds to CPU time, shared caches and cores, only ever adds).

Workloads: ``synthetic`` (the synthetic-cost stage with zero sleeps, so only the runtime's
own work is left: ``megatron/trainer/tasks/synthetic.py``) and ``gpt`` (one stage of the speed
issue's workload, ``benchmarks/peer_pipelining.py``'s ``WORKLOAD`` with the layers of one of its
two stages; ``--quick``: its tiny model).

    python benchmarks/investigations/instrumentation_overhead.py                   # paired, both workloads, ~3 min
    python benchmarks/investigations/instrumentation_overhead.py --end-to-end --rounds 3
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

REPO = Path(__file__).resolve().parents[2]
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
    """One end-to-end run in a fresh process (see the module docstring); its CPU ms per op."""
    cmd = [sys.executable, __file__, "--child", workload, variant, "--child-iters", str(iters), "--child-tmp", str(tmp),
           *(["--quick"] if quick else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{workload}/{variant} failed:\n{proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def end_to_end(workload: str, variants: list[str], rounds: int, quick: bool, iters: int) -> dict[str, list[float]]:
    """CPU ms per op of every variant, one fresh trainer process per run, interleaved by round."""
    runs: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="instrumentation-") as tmp:
        for r in range(rounds):
            for variant in variants:
                runs[variant].append(run_child(workload, variant, quick, iters, Path(tmp)))
            print(f"# {workload} round {r + 1}: " + ", ".join(f"{v} {runs[v][-1]:.4f}" for v in variants), flush=True)
    return runs


class PairedStage:
    """One trainer-built stage worker (N = 1) driven iteration by iteration with the variants'
    instrumentation switched on it (see the module docstring)."""

    def __init__(self, workload: str, quick: bool):
        from megatron.pipeline.runtime.tracing import StageTracer
        from megatron.trainer.loop.training import emulate, preflight

        argv, self.ops = workload_argv(workload, quick, 1)
        task = task_of(workload)
        with contextlib.redirect_stdout(io.StringIO()):
            args = preflight(task, [*argv, "--pipeline-executor", "emulator"])
            (self.worker,) = emulate(task, args)  # one iteration: the warm-up
        self.microbatches = self.ops // 2
        self.tracer = StageTracer(0, 0, self.worker.layout, "emulator", args.pipeline_schedule,
                                  self.microbatches, self.worker.setup.device)
        self.update = 1

    def switch(self, variant: str) -> None:
        on = set(VARIANTS[variant])
        self.worker.meter.measure_bytes = "--log-activation-memory" in on
        if "--trace-dir" in on:
            self.worker.hooks.start_tracing(self.tracer)
        else:
            self.worker.hooks.stop_tracing()
        self.worker.setup.report_params_norm = "--log-params-norm" in on

    def iteration(self) -> float:
        """Main-thread CPU ms per compute op of one iteration: F and BW of every micro-batch, the
        step and the report, as an executor runs them."""
        from megatron.pipeline.ir import BW, F, OPT
        from megatron.pipeline.runtime.executors.common import run_compute_op

        w, u = self.worker, self.update
        start = time.thread_time()
        for mb in range(u * self.microbatches, (u + 1) * self.microbatches):
            run_compute_op(w, F(0, mb), {})
            run_compute_op(w, BW(0, mb), {})
        op = OPT(0, u, sync=True)
        w.apply_update(op, [w.grad_sq_norm(op)])
        w.take_report(u)
        self.update += 1
        self.tracer.ops.clear()  # a long trace is written per segment; here it would only grow
        return 1000.0 * (time.thread_time() - start) / self.ops


def paired(workload: str, variants: list[str], rounds: int, quick: bool) -> dict[str, list[float]]:
    """CPU ms per op of every variant, the variants taking turns iteration by iteration."""
    stage = PairedStage(workload, quick)
    runs: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        order = variants if r % 2 == 0 else variants[::-1]  # neither side always goes first
        for variant in order:
            stage.switch(variant)
            runs[variant].append(stage.iteration())
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    p.add_argument("--child-iters", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-tmp", help=argparse.SUPPRESS)
    p.add_argument("--workloads", nargs="+", choices=("synthetic", "gpt"), default=["synthetic", "gpt"])
    p.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=None)
    p.add_argument("--end-to-end", action="store_true", help="whole trainer runs, one process per variant and round")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds (default: paired 300 synthetic / 12 gpt iterations; end-to-end 3)")
    p.add_argument("--synthetic-iters", type=int, default=60, help="end-to-end: iterations per run")
    p.add_argument("--gpt-iters", type=int, default=8, help="end-to-end: iterations per run")
    p.add_argument("--quick", action="store_true", help="the tiny GPT instead of the speed workload's stage")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.child:  # one timed end-to-end run in this process: print its CPU ms per op
        print(cpu_ms_per_op(a.child[0], a.child[1], a.quick, a.child_iters, Path(a.child_tmp)))
        return 0
    variants = a.variants or [v for v in VARIANTS if a.end_to_end or v != "drift"]
    if "off" not in variants:
        p.error("--variants must include off: the ratios are against it")
    if not a.end_to_end and "drift" in variants:
        p.error("drift has no switch on the worker (its bookkeeping always runs): time its flag with --end-to-end")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load = lambda: " ".join(Path("/proc/loadavg").read_text().split()[:3])  # noqa: E731
    print(f"# {'end-to-end' if a.end_to_end else 'paired'}; load average before: {load()}", flush=True)
    rows = []
    for workload in a.workloads:
        if a.end_to_end:
            iters = a.synthetic_iters if workload == "synthetic" else a.gpt_iters
            runs = end_to_end(workload, variants, a.rounds or 3, a.quick, iters)
        else:
            runs = paired(workload, variants, a.rounds or (300 if workload == "synthetic" else 12), a.quick)
        for variant in variants:
            ratios = [on / off for on, off in zip(runs[variant], runs["off"])]
            rows.append({"workload": workload, "variant": variant, "flags": " ".join(VARIANTS[variant]),
                         "cpu_ms_per_op": statistics.median(runs[variant]), "rounds": len(ratios),
                         "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)})
    print(f"\nload average after: {load()}\n")
    print("| workload | instrumentation | flags | CPU ms per op (median) | on / off per round: median (min-max) | rounds |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['variant']} | {r['flags'].replace('{trace}', 'DIR') or '-'} | "
              f"{r['cpu_ms_per_op']:.4f} | {r['ratio_median']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) | {r['rounds']} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
