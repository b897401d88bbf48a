"""Pure torch, no project code in the loop: does a per-iteration gloo collective grow the C heap?

Why this exists: the soak's 1F1B ranks showed a live-heap growth of 0.7-2.7 B/iteration,
decaying but not settled after 8-24k iterations, with no Python object of ours behind it
(``tracemalloc``) and none on PACI's ranks. The difference is the synchronous step's
``all_gather`` of the stages' squared norms, once per iteration. This script runs that
collective, nothing else, on two forked gloo ranks and samples ``mallinfo2``'s in-use bytes
(after ``gc.collect()``) into a preallocated array, so the sampling itself allocates nothing.

With glibc's per-thread cache on (the default), the same decaying growth appears; with it
off (``GLIBC_TUNABLES=glibc.malloc.tcache_count=0``, what this script and the soak probe set
unless ``--keep-tcache``), it does not: the growth was freed chunks parked in the threads'
caches (gloo's threads free what the main thread allocated), which ``mallinfo2`` counts as in
use and which are bounded by 7 chunks per size class per thread. See docs/benchmarks_history.md.

    python benchmarks/investigations/soak_tcache_repro.py --iters 10000                 # thread cache off
    python benchmarks/investigations/soak_tcache_repro.py --iters 10000 --keep-tcache   # glibc's default
    python benchmarks/investigations/soak_tcache_repro.py --iters 10000 --op p2p        # isend/irecv + wait instead
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from array import array
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.investigations.soak import slope  # noqa: E402
from benchmarks.investigations.soak_probe import c_heap_in_use, restart_without_tcache  # noqa: E402
from megatron.trainer.launch.flight_recorder import disable_unless_requested  # noqa: E402

TIMEOUT = timedelta(seconds=120)


def one_iteration(op: str, rank: int, value: torch.Tensor) -> None:
    """What the 1F1B step exchanges (``all_gather`` of one float64 per rank), or a P2P round trip."""
    if op == "all_gather":
        gathered = [torch.empty_like(value) for _ in range(2)]
        dist.all_gather(gathered, value)
    elif rank == 0:
        dist.isend(value, dst=1).wait(TIMEOUT)
    else:
        dist.irecv(torch.empty_like(value), src=0).wait(TIMEOUT)


def rank_main(rank: int, op: str, iters: int, every: int, store_dir: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(str(Path(store_dir) / "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=TIMEOUT)
    value = torch.ones(1, dtype=torch.float64)
    heap = array("q", bytes(8 * (iters // every)))  # allocated before the first sample
    for it in range(iters):
        one_iteration(op, rank, value)
        if it % every == 0:
            gc.collect()
            heap[it // every] = c_heap_in_use()
    dist.barrier()
    (Path(store_dir) / f"heap-{rank}").write_bytes(heap.tobytes())
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=10000)
    p.add_argument("--every", type=int, default=50, help="sample every N iterations")
    p.add_argument("--op", choices=("all_gather", "p2p"), default="all_gather")
    p.add_argument("--keep-tcache", action="store_true", help="leave glibc's per-thread cache on")
    args = p.parse_args()
    if not args.keep_tcache:
        restart_without_tcache()
    disable_unless_requested()  # as the trainer does: its ring of 2000 entries would grow the heap too
    fifth = args.iters // 5
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(rank_main, args=(args.op, args.iters, args.every, tmp), nprocs=2, start_method="fork")
        print(f"{args.op}, {args.iters} iterations, glibc thread cache {'on' if args.keep_tcache else 'off'}; "
              f"C heap in use after gc.collect(), slope per fifth of the run (B/iteration):")
        for rank in range(2):
            heap = array("q", (Path(tmp) / f"heap-{rank}").read_bytes())
            points = [(i * args.every, v) for i, v in enumerate(heap)]
            fifths = [slope([(x, y) for x, y in points if k * fifth <= x < (k + 1) * fifth]) for k in range(5)]
            print(f"rank {rank}: {heap[0] / 2**20:.4f} -> {heap[-1] / 2**20:.4f} MB; "
                  + " ".join(f"{v:.2f}" for v in fifths))


if __name__ == "__main__":
    main()
