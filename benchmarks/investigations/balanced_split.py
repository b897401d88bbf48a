"""Even vs balanced layer split on the speed issue's GPT, side by side in one run.

For each stage count and each split (``--pipeline-partition even`` and ``balanced``, the
analytic cost model's split) it runs each schedule through the distributed runtime (gloo, one
thread per rank, ``--trace-dir``) and reads the traces after ``--skip`` warm-up iterations:

- per stage: measured forward and backward (B + W) ms per micro-batch (medians of the op spans);
- ``busy``: the busiest stage's op time, the bottleneck-stage bound on the run's time;
- ``of bound``: that bound over the run's span (the slowest stage's first op to last op),
  i.e. the fraction of the bottleneck-stage bound the run reaches (1 - the measured bubble
  rate, :func:`megatron.pipeline.trace_analysis.bubble_rate`);
- tokens/s: tokens of the measured iterations over that span.

The issue's goal is "of bound >= 0.95" for paci and zb-2p with the balanced split; balance is
what ``busy`` shows (the even split's bound is its last stage's, which also runs the LM head).
On a loaded host the fractions are noisy; run it more than once before reading digits.

    python benchmarks/investigations/balanced_split.py                        # N = 2 and 4, m = 8, 1f1b paci zb-2p
    python benchmarks/investigations/balanced_split.py --stages 2 --microbatches 4 --iters 5 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megatron.pipeline.ir import OpKind  # noqa: E402
from megatron.pipeline.trace_analysis import (  # noqa: E402
    load_traces, replica, skip_iterations, stage_bubble)

WORKLOAD = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
            "--micro-batch-size", "4", "--vocab-size", "8192", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--num-threads", "1", "--device", "cpu", "--mock-data", "--lr", "1e-4", "--lr-decay-style", "constant"]
TOKENS_PER_MICROBATCH = 4 * 128
BACKWARD = (OpKind.B, OpKind.W, OpKind.BW)


def run(schedule: str, partition: str, stages: int, m: int, iters: int, skip: int, workdir: Path) -> dict:
    """One training run with traces; per-stage op times and the fraction of the bound."""
    trace_dir = workdir / f"{schedule}-{partition}-N{stages}"
    cmd = [sys.executable, str(REPO / "pretrain_gpt.py"), *WORKLOAD, "--pipeline-partition", partition,
           "--pipeline-model-parallel-size", str(stages), "--pipeline-schedule", schedule,
           "--global-batch-size", str(4 * m), "--train-iters", str(iters), "--log-interval", str(iters),
           "--trace-dir", str(trace_dir)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{schedule} {partition} N={stages} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    split = next((line.split("layer split: ", 1)[1] for line in done.stdout.splitlines()
                  if "layer split: " in line), "?")
    traces = replica(load_traces(trace_dir))
    kept = [skip_iterations(t.spans, skip, m) for t in traces]
    bubbles = [stage_bubble(spans) for spans in kept]
    busy = max(b.busy for b in bubbles)
    span = max(b.span for b in bubbles)

    def per_mb(spans: list, kinds: tuple[OpKind, ...]) -> float:
        """ms per micro-batch of these op kinds (summed per micro-batch, then the median)."""
        per: dict[int, float] = {}
        for sp in spans:
            if sp.op.kind in kinds:
                per[sp.op.microbatch] = per.get(sp.op.microbatch, 0.0) + sp.end - sp.start
        return statistics.median(per.values()) if per else 0.0

    return {
        "schedule": schedule, "partition": partition, "stages": stages, "m": m, "split": split,
        "forward_ms": [round(per_mb(s, (OpKind.F,)), 1) for s in kept],
        "backward_ms": [round(per_mb(s, BACKWARD), 1) for s in kept],
        "busy_ms": round(busy, 1), "span_ms": round(span, 1), "of_bound": round(busy / span, 3),
        "tokens_per_s": round(TOKENS_PER_MICROBATCH * m * (iters - skip) / (span / 1e3), 1),
    }


def predicted(stages: int) -> str:
    """The cost model's per-stage cost (in transformer layers) of the even and balanced splits."""
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.tasks.balanced_partition import model_shape
    from megatron.pipeline.costs.cost_model import layer_costs, layer_flops

    plan = parse_run_plan([*WORKLOAD, "--pipeline-model-parallel-size", str(stages), "--pipeline-executor", "emulator"])
    shape = model_shape(plan)
    times, unit = layer_costs(shape).time, layer_flops(shape)
    even = [plan.model.num_layers // stages] * stages
    out = []
    for name, counts in (("even", even), ("balanced", plan.layers.counts or even)):
        bounds, start = [], 0
        for c in counts:
            bounds.append(round(sum(times[start:start + c]) / unit, 2))
            start += c
        out.append(f"{name} {counts}: {bounds}")
    return f"N={stages} model stage cost in layers: " + "; ".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    p.add_argument("--schedules", nargs="+", default=["1f1b", "paci", "zb-2p"])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--skip", type=int, default=2, help="warm-up iterations left out of the measurement")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.iters <= args.skip:
        raise SystemExit("--iters must exceed --skip")
    rows = []
    for stages in args.stages:
        print(predicted(stages))
    print("| N | schedule | partition | split | fwd ms/mb per stage | bwd ms/mb per stage | bound (busy) ms | "
          "span ms | of bound | tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for stages in args.stages:
            for schedule in args.schedules:
                for partition in ("even", "balanced"):  # adjacent, so load drift hits both alike
                    r = run(schedule, partition, stages, args.microbatches, args.iters, args.skip, Path(tmp))
                    rows.append(r)
                    print(f"| {stages} | {schedule} | {partition} | {r['split']} | {r['forward_ms']} | "
                          f"{r['backward_ms']} | {r['busy_ms']} | {r['span_ms']} | {r['of_bound']} | "
                          f"{r['tokens_per_s']} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
