"""Soak: does any process's memory grow with the number of iterations trained?

Runs ``pretrain_gpt.py`` on a tiny model -- the emulator with PACI, then the distributed
runtime with PACI and 1F1B (one forked process per stage) -- while sampling the resident set
size (RSS) of every process from the outside (``/proc/<pid>/statm``) together with the
iteration the run has logged (its ``--log-json``). For each process it fits RSS against
iteration by least squares over the second half of the run (the first half is warm-up:
allocator pools, lazily imported modules and autograd caches fill once) and prints the slope
in bytes per iteration. Flat memory means a slope of at most about 1 byte per iteration.

    python benchmarks/soak.py                                    # 20k emulator + 2 x 2k distributed iterations
    python benchmarks/soak.py --emulator-iters 2000 --dist-iters 400 --json soak.json

The defaults take about 12 minutes on a 2-core machine shared with other work (4000 emulator
iterations took 104 s there, 2000 distributed ones 91-122 s; see docs/benchmarks.md).
The sampler is also used by ``tests/test_memory_flat.py``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGE = os.sysconf("SC_PAGE_SIZE")

#: the tiny model every soak run trains (hidden 32, seq 32, 2 layers, vocab 64)
TINY_MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
              "--vocab-size", "64", "--micro-batch-size", "2", "--hidden-dropout", "0", "--attention-dropout", "0",
              "--num-threads", "1", "--lr", "1e-3", "--lr-warmup-iters", "1"]


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` in bytes; None once it has exited."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return None


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (the forked ranks of a local launch), by scanning /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may contain spaces, so split after the last ')'
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry))
    return sorted(out)


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return str(pid)


class LogTail:
    """The last iteration a ``--log-json`` file has recorded, read incrementally."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._partial = ""
        self.iteration = 0

    def poll(self) -> int:
        try:
            with open(self.path) as f:
                f.seek(self._offset)
                chunk = f.read()
                self._offset = f.tell()
        except FileNotFoundError:
            return self.iteration
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()
        for line in lines:
            record = json.loads(line)
            if "eval_split" not in record:
                self.iteration = record["iteration"]
        return self.iteration


@dataclass
class Sampled:
    """RSS samples ``(iteration, bytes)`` per process name of one run."""

    series: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    wall_s: float = 0.0
    returncode: int = 0


def sample_run(cmd: list[str], log: Path, ranks: bool, interval_s: float = 0.05, timeout_s: float = 3600.0,
               env: dict[str, str] | None = None) -> Sampled:
    """Run ``cmd`` (writing ``--log-json`` to ``log``) and sample RSS until it exits.

    ``ranks``: sample the launched process's children (a local multi-rank launch) instead of
    the process itself (the emulator). Samples taken before the first logged iteration are
    dropped: start-up (imports, model build) is not what is measured.
    """
    out = Sampled()
    tail = LogTail(log)
    began = time.monotonic()
    err_path = log.with_suffix(".stderr")
    err = open(err_path, "w")  # a file, not a pipe: a pipe nobody drains would block a chatty run
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                            env=env or dict(os.environ, PYTHONWARNINGS="ignore"))
    pids: list[int] = []
    try:
        while proc.poll() is None:
            if time.monotonic() - began > timeout_s:
                raise TimeoutError(f"{' '.join(cmd)} ran past {timeout_s:.0f} s")
            iteration = tail.poll()
            if iteration > 0:
                pids = pids or (children(proc.pid) if ranks else [proc.pid])  # scanning /proc is slow: once
                for pid in pids:
                    rss = rss_bytes(pid)
                    if rss:  # None or 0: exited (a zombie reads 0)
                        out.series.setdefault(process_name(pid), []).append((iteration, rss))
            time.sleep(interval_s)
    finally:
        if proc.poll() is None:  # timed out or interrupted: end the ranks, then their launcher
            for pid in pids if ranks else []:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.kill()
        proc.wait()
        err.close()
    out.wall_s = time.monotonic() - began
    out.returncode = proc.returncode
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{err_path.read_text()[-3000:]}")
    return out


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


def after(points: list[tuple[int, int]], first_iteration: int) -> list[tuple[int, int]]:
    return [(x, y) for x, y in points if x >= first_iteration]


def summarize(name: str, run: Sampled, iters: int) -> list[dict]:
    """One row per process: RSS at the end of warm-up and at the end, slope over the second half."""
    rows = []
    for proc, points in sorted(run.series.items()):
        # the last iteration is shutdown (ranks drain and free everything), not steady state
        steady = [(x, y) for x, y in after(points, iters // 2) if x < iters]
        rows.append({
            "run": name, "process": proc, "samples": len(steady),
            "rss_warm_mb": steady[0][1] / 2**20 if steady else float("nan"),
            "rss_end_mb": steady[-1][1] / 2**20 if steady else float("nan"),
            "slope_bytes_per_iter": slope(steady), "wall_s": run.wall_s,
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
    p.add_argument("--dist-iters", type=int, default=2000)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=2, help="micro-batches per iteration")
    p.add_argument("--dist-schedules", nargs="+", default=["paci", "1f1b"])
    p.add_argument("--emulator-schedule", default="paci")
    p.add_argument("--hidden-size", type=int, default=32)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--interval", type=float, default=0.2, help="seconds between RSS samples")
    p.add_argument("--json", default=None, help="write the rows and raw samples here")
    args = p.parse_args()

    model = list(TINY_MODEL)
    model[model.index("--hidden-size") + 1] = str(args.hidden_size)
    model[model.index("--seq-length") + 1] = str(args.seq_length)
    model[model.index("--num-layers") + 1] = str(max(2, args.stages))
    runs: list[tuple[str, list[str], bool, int]] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.emulator_iters > 0:
            log = Path(tmp) / "emulator.jsonl"
            runs.append((f"emulator {args.emulator_schedule}", pretrain_cmd(
                args.emulator_schedule, args.stages, args.microbatches, args.emulator_iters, log, model, True),
                False, args.emulator_iters))
        if args.dist_iters > 0:
            for schedule in args.dist_schedules:
                log = Path(tmp) / f"dist-{schedule}.jsonl"
                runs.append((f"distributed {schedule}", pretrain_cmd(
                    schedule, args.stages, args.microbatches, args.dist_iters, log, model, False), True, args.dist_iters))
        rows, raw = [], {}
        for name, cmd, ranks, iters in runs:
            log = Path(cmd[cmd.index("--log-json") + 1])
            run = sample_run(cmd, log, ranks=ranks, interval_s=args.interval)
            rows.extend(summarize(name, run, iters))
            raw[name] = run.series
            print(f"{name}: {iters} iterations in {run.wall_s:.0f} s", flush=True)
    print("\n| run | process | RSS after warm-up (MB) | RSS at end (MB) | slope (bytes/iteration) | samples |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['process']} | {r['rss_warm_mb']:.1f} | {r['rss_end_mb']:.1f} | "
              f"{r['slope_bytes_per_iter']:.2f} | {r['samples']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "samples": raw}, indent=1))


if __name__ == "__main__":
    main()
