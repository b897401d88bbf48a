"""Soak: does any process's memory grow with the number of iterations trained?

Runs ``pretrain_gpt.py`` on a tiny model -- the emulator with PACI, then the distributed
runtime with PACI and 1F1B (one forked process per stage) -- under
:mod:`benchmarks.investigations.soak_probe`, which samples every process at update boundaries after a full
``gc.collect()``: its *live heap* (bytes malloc and pymalloc have handed out and not had
back, exact to the byte) and its RSS. For each process it fits both against the update
number by least squares after warm-up (the first half of the run by default) and prints
the slopes in bytes per iteration. The live-heap slope is the leak criterion: RSS moves in
4 KiB pages when the allocator first touches a page, however rarely, so a single page in
the second half of a 2000-iteration run reads as 4 B/iteration (see the probe's docstring
and docs/benchmarks_history.md). ``--leak-bytes N --leak-every K`` injects a deliberate leak of one
``bytes(N)`` every K updates into every process, to show what a leak of that size reads as.

    python benchmarks/investigations/soak.py                                    # 20k emulator + 2 x 8k distributed iterations
    python benchmarks/investigations/soak.py --emulator-iters 4000 --dist-iters 2000 --json soak.json
    python benchmarks/investigations/soak.py --emulator-iters 0 --dist-iters 1000 --dist-schedules paci --leak-bytes 64 --leak-every 64

Every process runs with glibc's per-thread cache off (``soak_probe`` sets the tunable; ``--keep-tcache``
leaves it on): ``mallinfo2`` counts the freed chunks the caches hold as in use, and their slow
filling read as a "growth" on the 1F1B ranks decaying from 18 to 0.3 B/iteration over 24k iterations.

The distributed default is 8k iterations, not the issue's 2k: CPython's own heap (pymalloc)
still settles by 1-2 B/iteration between iterations 1000 and 2000 (see docs/benchmarks_history.md).
12000 emulator iterations took 374 s and 8000 distributed ones 224-319 s on a 2-core machine
under a load average of about 40 (other sessions).
``run_probed``, ``steady`` and ``slope`` are also used by ``tests/test_memory_flat.py``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.investigations.soak_probe import Series, read  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

#: the tiny model every soak run trains (hidden 32, seq 32, 2 layers, vocab 64)
TINY_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
              "--vocab-size", "64", "--micro-batch-size", "2", "--hidden-dropout", "0", "--attention-dropout", "0",
              "--num-threads", "1", "--lr", "1e-3", "--lr-warmup-iters", "1"]


def slope(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of bytes against iteration (bytes per iteration)."""
    n = len(points)
    if n < 2:
        return float("nan")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return float("nan")
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def median_slope(points: list[tuple[int, int]]) -> float:
    """Theil-Sen slope: the median of the slopes between all pairs of samples.

    Steady growth (a leak) moves every pair's slope; a one-off step (the allocator extending
    the heap when a timing-dependent peak of live tensors is reached for the first time) moves
    only the pairs that straddle it, so the median ignores it unless steps are everywhere.
    """
    pairs = sorted((y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points) for x2, y2 in points[i + 1:] if x2 != x1)
    return pairs[len(pairs) // 2] if pairs else float("nan")


def run_probed(cmd: list[str], out: Path, probe_args: list[str], timeout_s: float = 3600.0) -> tuple[list[Series], float]:
    """Run the training command ``cmd`` (``[python, script, *args]``) under
    :mod:`benchmarks.investigations.soak_probe` writing to ``out``; return every process's samples and the wall time."""
    out.mkdir(parents=True, exist_ok=True)
    probed = [cmd[0], str(REPO / "benchmarks" / "investigations" / "soak_probe.py"), "--out", str(out), *probe_args, "--", *cmd[1:]]
    began = time.monotonic()
    err = out / "stderr.txt"
    with open(err, "w") as f:  # a file, not a pipe: a pipe nobody drains would block a chatty run
        proc = subprocess.run(probed, cwd=REPO, stdout=subprocess.DEVNULL, stderr=f, timeout=timeout_s,
                              env=dict(os.environ, PYTHONWARNINGS="ignore"))
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(probed)} exited {proc.returncode}:\n{err.read_text()[-3000:]}")
    return read(out), time.monotonic() - began


def steady(points: list[tuple[int, int]], warmup: int, last: int) -> list[tuple[int, int]]:
    """Samples from update ``warmup`` on, before ``last`` (the final update drains and frees)."""
    return [(x, y) for x, y in points if warmup <= x < last]


def summarize(name: str, series: list[Series], iters: int, warmup: int, wall_s: float) -> list[dict]:
    """One row per process: live heap and RSS after warm-up and at the end, slopes after warm-up."""
    rows = []
    for s in series:
        live, resident = steady(s.column("live"), warmup, iters), steady(s.column("rss"), warmup, iters)
        objects = steady(s.column("gc_objects"), warmup, iters)
        rows.append({
            "run": name, "process": s.name, "samples": len(live),
            "live_warm_mb": live[0][1] / 2**20, "live_end_mb": live[-1][1] / 2**20,
            "live_slope": slope(live), "live_median_slope": median_slope(live),
            "rss_warm_mb": resident[0][1] / 2**20, "rss_end_mb": resident[-1][1] / 2**20,
            "rss_slope": slope(resident), "gc_objects_slope": slope(objects), "wall_s": wall_s,
        })
    return rows


def pretrain_cmd(schedule: str, stages: int, microbatches: int, iters: int, log: Path, model: list[str],
                 emulator: bool) -> list[str]:
    micro = int(model[model.index("--micro-batch-size") + 1])
    cmd = [sys.executable, str(REPO / "pretrain_gpt.py"), *model, "--pipeline-model-parallel-size", str(stages),
           "--pipeline-schedule", schedule, "--global-batch-size", str(micro * microbatches),
           "--train-iters", str(iters), "--log-interval", "1", "--log-json", str(log)]
    return [*cmd, "--pipeline-executor", "emulator"] if emulator else cmd


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--emulator-iters", type=int, default=20000)
    p.add_argument("--dist-iters", type=int, default=8000,
                   help="the ranks warm up for several thousand iterations (torch-internal allocations)")
    p.add_argument("--warmup", type=float, default=0.5, help="fraction of each run left out of the slopes")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=2, help="micro-batches per iteration")
    p.add_argument("--dist-schedules", nargs="+", default=["paci", "1f1b"])
    p.add_argument("--emulator-schedule", default="paci")
    p.add_argument("--hidden-size", type=int, default=32)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--every", type=int, default=10, help="sample every N updates")
    p.add_argument("--trim", action="store_true", help="malloc_trim(0) before each sample (RSS without free pages)")
    p.add_argument("--keep-tcache", action="store_true",
                   help="leave glibc's per-thread cache on: its freed chunks then count as live (see soak_probe)")
    p.add_argument("--leak-bytes", type=int, default=0,
                   help="inject a deliberate leak of bytes(N) per update (shows the metric catches one)")
    p.add_argument("--leak-every", type=int, default=1, help="... every N updates")
    p.add_argument("--json", default=None, help="write the rows and raw samples here")
    args = p.parse_args()

    model = list(TINY_MODEL)
    model[model.index("--hidden-size") + 1] = str(args.hidden_size)
    model[model.index("--seq-length") + 1] = str(args.seq_length)
    model[model.index("--num-layers") + 1] = str(max(2, args.stages))
    probe_args = ["--every", str(args.every), "--leak-bytes", str(args.leak_bytes), "--leak-every", str(args.leak_every)]
    probe_args += ["--trim"] if args.trim else []
    probe_args += ["--keep-tcache"] if args.keep_tcache else []
    runs: list[tuple[str, str, bool, int]] = []
    if args.emulator_iters > 0:
        runs.append((f"emulator {args.emulator_schedule}", args.emulator_schedule, True, args.emulator_iters))
    if args.dist_iters > 0:
        runs += [(f"distributed {schedule}", schedule, False, args.dist_iters) for schedule in args.dist_schedules]
    rows, raw = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, schedule, emulator, iters in runs:
            out = Path(tmp) / name.replace(" ", "-")
            cmd = pretrain_cmd(schedule, args.stages, args.microbatches, iters, out / "log.jsonl", model, emulator)
            series, wall_s = run_probed(cmd, out, probe_args)
            rows.extend(summarize(name, series, iters, int(iters * args.warmup), wall_s))
            raw[name] = {s.name: s.rows for s in series}
            print(f"{name}: {iters} iterations in {wall_s:.0f} s", flush=True)
    print(f"\nslopes in bytes per iteration over updates {args.warmup:.0%} to the end, one sample every {args.every} "
          f"updates after a full gc.collect(){' and malloc_trim(0)' if args.trim else ''}"
          f"{', glibc thread cache on' if args.keep_tcache else ', glibc thread cache off'}"
          f"{f'; deliberate leak: {args.leak_bytes} B every {args.leak_every} updates' if args.leak_bytes else ''}")
    print("| run | process | live heap after warm-up -> end (MB) | live heap slope | (Theil-Sen) "
          "| RSS after warm-up -> end (MB) | RSS slope | gc objects / iteration | samples |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['process']} | {r['live_warm_mb']:.3f} -> {r['live_end_mb']:.3f} | "
              f"{r['live_slope']:.2f} | {r['live_median_slope']:.2f} | {r['rss_warm_mb']:.1f} -> {r['rss_end_mb']:.1f} | "
              f"{r['rss_slope']:.2f} | {r['gc_objects_slope']:.4f} | {r['samples']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "samples": raw}, indent=1))


if __name__ == "__main__":
    main()
