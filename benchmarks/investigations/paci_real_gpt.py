"""Real tiny GPT on CPU through the distributed runtime: PACI vs 1F1B-flush, side by side.

Each schedule runs as N local gloo ranks with one thread each. Reports steady-state tokens/s
(median over the logged intervals after warm-up), the PACI / 1F1B ratio next to the
theoretical (m + N - 1) / m, and peak in-flight micro-batches and saved-activation MB per stage
(PACI must equal 1F1B-flush).

    python benchmarks/investigations/paci_real_gpt.py                 # N=2, m in 2 4 8
    python benchmarks/investigations/paci_real_gpt.py --stages 2 --microbatches 4 --iters 30 --json out.json
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
MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
         "--vocab-size", "512", "--micro-batch-size", "4", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--num-threads", "1", "--log-activation-memory"]


def run(schedule: str, stages: int, m: int, iters: int, workdir: Path) -> dict:
    log = workdir / f"{schedule}-N{stages}-m{m}.jsonl"
    cmd = [sys.executable, str(REPO / "pretrain_gpt.py"), *MODEL, "--pipeline-model-parallel-size", str(stages),
           "--pipeline-schedule", schedule, "--global-batch-size", str(4 * m), "--train-iters", str(iters),
           "--log-interval", "2", "--log-json", str(log)]
    subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steady = records[len(records) // 3:]  # skip warm-up intervals
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "peak_inflight": [max(r["peak_inflight_microbatches"][s] for r in records) for s in range(stages)],
        "peak_activation_mb": [max(r["peak_activation_mb"][s] for r in records) for s in range(stages)],
        "final_loss": records[-1]["loss"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--iters", type=int, default=24)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in args.microbatches:
            flush = run("1f1b", args.stages, m, args.iters, Path(tmp))
            paci = run("paci", args.stages, m, args.iters, Path(tmp))
            theory = (m + args.stages - 1) / m
            rows.append({"N": args.stages, "m": m, "1f1b_tokens_per_s": flush["tokens_per_s"],
                         "paci_tokens_per_s": paci["tokens_per_s"],
                         "speedup": paci["tokens_per_s"] / flush["tokens_per_s"], "theory": theory,
                         "speedup_over_theory": paci["tokens_per_s"] / flush["tokens_per_s"] / theory,
                         "1f1b_peak_inflight": flush["peak_inflight"], "paci_peak_inflight": paci["peak_inflight"],
                         "1f1b_peak_act_mb": flush["peak_activation_mb"], "paci_peak_act_mb": paci["peak_activation_mb"]})
    print("| N | m | 1F1B tok/s | PACI tok/s | PACI/1F1B | theory (m+N-1)/m | measured/theory | peak in-flight 1F1B | peak in-flight PACI | peak act MB 1F1B | peak act MB PACI |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['N']} | {r['m']} | {r['1f1b_tokens_per_s']:.0f} | {r['paci_tokens_per_s']:.0f} | {r['speedup']:.3f} | "
              f"{r['theory']:.3f} | {r['speedup_over_theory']:.3f} | {r['1f1b_peak_inflight']} | {r['paci_peak_inflight']} | "
              f"{[round(x, 2) for x in r['1f1b_peak_act_mb']]} | {[round(x, 2) for x in r['paci_peak_act_mb']]} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
