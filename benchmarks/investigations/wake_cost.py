"""What the same CPU work costs right after a sleep, against back to back: this host's floor
under the synthetic-cost benchmarks.

The synthetic-cost stages (``megatron/trainer/tasks/synthetic.py``) sleep for their forward
and backward, so every op's own work (the tiny linear, autograd, the runtime's bookkeeping,
gloo's ``isend``/``irecv``) runs on a core that has just woken. How much slower that work is
than the same work back to back is a property of the host (its idle states, and on a shared
virtual machine the other tenants that ran on the core meanwhile), not of the runtime; on
the 2-core VM these benchmarks run on it is several times slower. This script measures it, so
that a schedule's overhead per op in ``schedule_efficiency.py`` can be read against it:

- *tiny linear F+B*: one forward and backward of the synthetic stage's ``[8, 1, 16]`` linear,
  i.e. the model's own work in one synthetic F+BW pair;
- *gloo isend*: posting one 512-byte ``isend`` to a second process that has its receive
  posted (the call a stage makes at the end of every op that sends).

Each is timed back to back ("warm") and right after ``time.sleep`` of each given length, median
of ``--repeats``; one torch thread, Linux timer slack 1 ns (as in the synthetic stages).

    python benchmarks/investigations/wake_cost.py                        # sleeps of 1 and 20 ms, ~8 s
    python benchmarks/investigations/wake_cost.py --sleep-ms 5 20 40 --repeats 200
"""
from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron.trainer.launch.launcher import free_port  # noqa: E402
from benchmarks.harness.wake_probe import SHAPE, linear_costs  # noqa: E402
from megatron.trainer.tasks.synthetic import sleep_until  # noqa: E402

def _isend_rank(rank: int, port: int, sleeps_s: list[float], repeats: int, results: "mp.Queue[list[float]]") -> None:
    """Rank 0 times ``isend`` after each sleep; rank 1 keeps a receive posted and answers each
    message (so rank 0's next send always finds its receive posted, as a prefetching stage does)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    payload, reply = torch.zeros(SHAPE), torch.zeros(1)
    rounds = 10 + repeats
    try:
        if rank == 1:
            for _ in sleeps_s:
                for _ in range(rounds):
                    dist.recv(payload, src=0)
                    dist.send(reply, dst=0)
            return
        costs = []
        for sleep_s in sleeps_s:
            times = []
            for i in range(rounds):
                if sleep_s > 0:
                    sleep_until(time.perf_counter() + sleep_s)
                start = time.perf_counter()
                work = dist.isend(payload, dst=1)
                if i >= 10:
                    times.append(time.perf_counter() - start)
                work.wait()
                dist.recv(reply, src=1)
            costs.append(1e6 * statistics.median(times))
        results.put(costs)
    finally:
        dist.destroy_process_group()


def isend_costs(sleeps_s: list[float], repeats: int) -> list[float]:
    """The gloo ``isend`` after each sleep of ``sleeps_s``, between two spawned processes."""
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_isend_rank, args=(r, port, sleeps_s, repeats, results), daemon=True)
             for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        while True:  # until rank 0 reports; a rank that died ends the wait at once
            try:
                costs = results.get(timeout=1.0)
                break
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"an isend probe process exited with {failed[0]}") from None
        for p in procs:
            p.join(timeout=60)
        return costs
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()


def table(rows: dict[str, list[float]], sleeps_ms: list[float]) -> str:
    """Markdown: warm and after-sleep medians per row, and each after-sleep cost over warm."""
    header = ["work", "warm us"] + [f"after {s:g} ms sleep us" for s in sleeps_ms] + \
             [f"{s:g} ms / warm" for s in sleeps_ms]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, (warm, *after) in rows.items():
        cells = [name, f"{warm:.1f}"] + [f"{a:.1f}" for a in after] + [f"{a / warm:.1f}x" for a in after]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sleep-ms", type=float, nargs="+", default=[1.0, 20.0])
    p.add_argument("--repeats", type=int, default=100)
    args = p.parse_args(argv)
    if args.repeats < 1 or any(s <= 0 for s in args.sleep_ms):
        p.error("--repeats must be >= 1 and every --sleep-ms > 0")
    sleeps_s = [0.0] + [s / 1000.0 for s in args.sleep_ms]
    print(f"# {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}; medians of {args.repeats}", flush=True)
    rows = {"tiny linear F+B": linear_costs(sleeps_s, args.repeats),
            f"gloo isend, {torch.zeros(SHAPE).nbytes} B": isend_costs(sleeps_s, args.repeats)}
    print(table(rows, args.sleep_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
