"""The planner's predictions against the runtime's measurements on this machine (issue 32).

For a GPT (default: hidden 256, 8 layers, vocab 8192, seq 128) at pipeline depths 2 and 4 and
m in {4, 8} micro-batches, every schedule that runs at that size with the even split and no
recompute: the planner's predicted iteration time from costs profiled here
(``tools/plan_pipeline.py --profile``'s path) against the distributed runtime's median
``iteration_time_ms`` (first ``--skip`` iterations dropped: allocation and, for zb-1p/zb-2p,
profiling), their ratio, the ranking's Spearman correlation per depth, and the predicted peak
activation bytes against ``--log-activation-memory``'s measured peak (largest stage).

    python benchmarks/planner_vs_runtime.py --iters 6 --skip 3 --pipeline-sizes 2 --microbatches 4
    python benchmarks/planner_vs_runtime.py --auto      # the issue's full grid, and auto against the best

With ``--auto`` each (N, m) also runs ``--pipeline-schedule auto`` (profiling its first 2
iterations, which ``--skip`` drops) and prints its throughput over the best measured
synchronous schedule's (the issue's bar: within 5 %).

Timings are only meaningful on a quiet host: the script prints the load average before and after.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron.pipeline.planner.candidates import enumerate_candidates  # noqa: E402
from megatron.pipeline.planner.evaluate import Problem, evaluate  # noqa: E402
from megatron.pipeline.planner.report import flags  # noqa: E402
from megatron.pipeline.schedules import schedule_class  # noqa: E402

MODEL = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
         "--max-position-embeddings", "128", "--vocab-size", "8192", "--micro-batch-size", "1"]


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else float("nan")


def measure(cand_flags: list[str], m: int, iters: int, skip: int, workdir: Path) -> tuple[float, float, str]:
    """(median iteration ms after ``skip``, peak activation MB of the largest stage, stdout) of one run."""
    log = workdir / f"run-{abs(hash(tuple(cand_flags))) % 10**8}-{m}.jsonl"
    cmd = [sys.executable, str(REPO / "pretrain_gpt.py"), *MODEL, *cand_flags, "--global-batch-size", str(m),
           "--train-iters", str(iters), "--log-interval", "1", "--mock-data", "--num-threads", "1",
           "--log-activation-memory", "--log-json", str(log)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    if run.returncode:
        raise RuntimeError(f"{' '.join(cand_flags)}: exit {run.returncode}: {run.stderr.strip().splitlines()[-1:]}")
    records = [json.loads(line) for line in log.read_text().splitlines() if '"eval_split"' not in line]
    times = [r["iteration_time_ms"] for r in records[skip:]]
    return statistics.median(times), max(max(r["peak_activation_mb"]) for r in records), run.stdout


def measure_auto(n: int, m: int, iters: int, skip: int, workdir: Path) -> tuple[float, str]:
    """(median iteration ms after ``skip`` of ``--pipeline-schedule auto``, its choice): its
    first ``--zb-profile-iters`` (2) iterations profile, ``skip`` must cover them."""
    flags = ["--pipeline-model-parallel-size", str(n), "--pipeline-schedule", "auto", "--pipeline-partition", "even"]
    ms, _, out = measure(flags, m, iters, skip, workdir)
    chose = next((line.split("auto: chose ", 1)[1].split()[0] for line in out.splitlines() if "auto: chose " in line), "?")
    return ms, chose


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pipeline-sizes", default="2,4")
    p.add_argument("--microbatches", default="4,8")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--skip", type=int, default=4)
    p.add_argument("--schedules", default=None, help="comma-separated subset (default: every one that runs)")
    p.add_argument("--costs", default=None, help="unit costs file (default: profile here)")
    p.add_argument("--auto", action="store_true",
                   help="also run --pipeline-schedule auto per (N, m) against the best measured synchronous schedule")
    args = p.parse_args(argv)
    from megatron.pipeline.planner.unit_costs import load_unit_costs
    from megatron.trainer.config.arguments import build_parser, parse_args
    from megatron.trainer.tasks.balanced_partition import model_shape

    print(f"load average before: {os.getloadavg()}")
    base = parse_args([*MODEL, "--global-batch-size", "4", "--mock-data"], build_parser())
    shape = model_shape(base)
    if args.costs:
        unit = load_unit_costs(args.costs)
    else:
        from megatron.trainer.tasks.plan_profile import profile_unit_costs

        unit = profile_unit_costs(base, threads=1)  # the measured runs' --num-threads 1
    print(f"unit costs ({unit.source}): {json.dumps(dataclasses.asdict(unit))}")
    schedules = args.schedules.split(",") if args.schedules else None
    rows, autos = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(v) for v in args.pipeline_sizes.split(",")):
            for m in (int(v) for v in args.microbatches.split(",")):
                problem = Problem(shape, unit, m)
                for cand, _ in enumerate_candidates(shape, [n], m, 1, schedules, ("none",), ("even",), 1):
                    if cand is None:
                        continue
                    try:
                        result = evaluate(problem, cand)
                        measured, act_mb, _ = measure(flags(cand, shape.num_layers), m, args.iters, args.skip, Path(tmp))
                    except Exception as e:  # noqa: BLE001 - report the candidate, go on
                        print(f"skip {cand.schedule} N={n} m={m}: {e}")
                        continue
                    predicted_act = max(mem.activations for mem in result.memory) / 2**20
                    rows.append((n, m, cand.schedule, result.iteration_time_ms, measured, predicted_act, act_mb))
                    print(f"{n} {m:>2} {cand.schedule:<16} predicted {result.iteration_time_ms:9.1f} ms measured "
                          f"{measured:9.1f} ms ratio {result.iteration_time_ms / measured:5.2f} | activations "
                          f"predicted {predicted_act:7.1f} MB measured {act_mb:7.1f} MB", flush=True)
                if args.auto:
                    auto_ms, chose = measure_auto(n, m, args.iters, args.skip, Path(tmp))
                    autos.append((n, m, chose, auto_ms))
                    print(f"{n} {m:>2} auto chose {chose}: measured {auto_ms:.1f} ms", flush=True)
    print("\n| N | m | schedule | predicted ms | measured ms | ratio | pred. act. MB | meas. act. MB | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, m, name, pred, meas, pa, ma in rows:
        print(f"| {n} | {m} | {name} | {pred:.1f} | {meas:.1f} | {pred / meas:.2f} | {pa:.1f} | {ma:.1f} | "
              f"{pa / ma if ma else float('nan'):.2f} |")
    for n in sorted({r[0] for r in rows}):
        sub = [r for r in rows if r[0] == n]
        print(f"N={n}: Spearman (predicted vs measured iteration time) = "
              f"{spearman([r[3] for r in sub], [r[4] for r in sub]):.2f} over {len(sub)} candidates; within 10 %: "
              f"{sum(abs(r[3] / r[4] - 1) <= 0.10 for r in sub)}/{len(sub)}")
    for n, m, chose, auto_ms in autos:
        sync = [r for r in rows if r[0] == n and r[1] == m and not schedule_class(r[2]).asynchronous]
        best = min(sync, key=lambda r: r[4]) if sync else None
        if best is not None:
            print(f"N={n} m={m}: auto chose {chose}, {auto_ms:.1f} ms; best measured synchronous {best[2]} "
                  f"{best[4]:.1f} ms; auto / best throughput {best[4] / auto_ms:.3f}")
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
