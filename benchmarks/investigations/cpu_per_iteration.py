"""CPU seconds one training iteration costs all ranks together, against its wall time.

Why: at 4 pipeline ranks on a 2-core host the planner's processor-sharing replay under-predicts
the iteration time by 5-20 % (docs/planning.md, issue 32). This separates the two candidate
causes: if the ranks burn more CPU per iteration than at 2 ranks on 2 cores, the cores do more
work (a throughput loss the replay does not count); if not, the loss is in how the time-sliced
cores order the work.

The marginal cost of an iteration is the difference between a run of ``--long`` and one of
``--short`` iterations (start-up cancels): CPU from ``getrusage(RUSAGE_CHILDREN)`` around each
run (the local launcher's ranks are its children), wall from the runs' own log. Run it on a
quiet host: ``python benchmarks/investigations/cpu_per_iteration.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The planner benchmark's model (benchmarks/planner.py).
MODEL = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
         "--max-position-embeddings", "128", "--vocab-size", "8192", "--micro-batch-size", "1"]
CASES = [(2, "1f1b", []), (4, "1f1b", []),
         (2, "interleaved-1f1b", ["--num-layers-per-virtual-pipeline-stage", "2"]),
         (4, "interleaved-1f1b", ["--num-layers-per-virtual-pipeline-stage", "1"]), (4, "zb-h1", [])]


def run(flags: list[str], m: int, iters: int) -> tuple[float, float]:
    """(CPU seconds of all ranks, median wall ms per iteration after the first 3) of one run."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = [sys.executable, str(REPO / "pretrain_gpt.py"), *MODEL, *flags, "--global-batch-size", str(m),
               "--train-iters", str(iters), "--log-interval", "1", "--mock-data", "--num-threads", "1",
               "--pipeline-partition", "even", "--log-json", log]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode:
            raise SystemExit(f"error: {' '.join(flags)}: {proc.stderr.strip().splitlines()[-1:]}")
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        with open(log) as f:
            records = [json.loads(line) for line in f if '"eval_split"' not in line]
        return cpu, statistics.median(r["iteration_time_ms"] for r in records[3:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--short", type=int, default=6)
    p.add_argument("--long", type=int, default=18)
    args = p.parse_args(argv)
    print(f"load average before: {os.getloadavg()}")
    for n, schedule, extra in CASES:
        flags = ["--pipeline-model-parallel-size", str(n), "--pipeline-schedule", schedule, *extra]
        cpu_short, _ = run(flags, args.microbatches, args.short)
        cpu_long, wall = run(flags, args.microbatches, args.long)
        per_iteration = (cpu_long - cpu_short) / (args.long - args.short) * 1e3
        print(f"N={n} {schedule:17s} CPU per iteration {per_iteration:7.1f} ms (all ranks) | wall {wall:6.1f} ms",
              flush=True)
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
