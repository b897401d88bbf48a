"""Overlap fraction of the data-parallel gradient reduction on CPU gloo, DP=2, PP=1.

Two ranks train the same MLP stack (``--layers`` x Linear(width, width), ``--microbatches``
per update) twice, side by side in one launch:

* ``at step``: every gradient is reduced at the step in one bucket (what the runtime does
  without ``--overlap-grad-reduce``: one concatenation, one all-reduce);
* ``overlapped``: :class:`~megatron.pipeline.runtime.grad_buckets.OverlappedGradReduce` with
  ``--bucket-size`` elements, buckets launched inside the last micro-batch's backward.

For each, the step's exposed reduction time is the wall time of ``finish()`` (what the step
waits for), median over the measured iterations. The overlap fraction is
``1 - exposed(overlapped) / exposed(at step)``: the share of the reduction hidden behind the
backward. Run from the repository root::

    OMP_NUM_THREADS=1 python benchmarks/investigations/grad_overlap.py
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.pipeline.runtime.grad_buckets import OverlappedGradReduce  # noqa: E402
from megatron.trainer.launch.launcher import free_port  # noqa: E402


def _measure(rank: int, args: argparse.Namespace, bucket_size: int, overlap: bool) -> tuple[float, float]:
    """Median (exposed reduction seconds, iteration seconds) of one mode on this rank."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.Tanh())
                                  for _ in range(args.layers)])
    sync = OverlappedGradReduce([list(model.parameters())], bucket_size, None, 2,
                                datetime.timedelta(seconds=120))
    gen = torch.Generator().manual_seed(rank)
    exposed, whole = [], []
    for it in range(args.warmup + args.iters):
        model.zero_grad(set_to_none=True)
        begin = time.perf_counter()
        for mb in range(args.microbatches):
            x = torch.randn(args.batch, args.width, generator=gen)
            if overlap:
                with sync.grad_op(it, args.microbatches, 0, completes=True):
                    model(x).square().mean().backward()
            else:
                model(x).square().mean().backward()
        start = time.perf_counter()
        sync.finish()
        end = time.perf_counter()
        if it >= args.warmup:
            exposed.append(end - start)
            whole.append(end - begin)
    return statistics.median(exposed), statistics.median(whole)


def _worker(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        numel = args.layers * (args.width * args.width + args.width)
        plain = _measure(rank, args, numel, overlap=False)
        over = _measure(rank, args, args.bucket_size, overlap=True)
        if rank == 0:
            print(f"DP=2 PP=1 gloo, {args.layers} x Linear({args.width}, {args.width}) = {numel:,} parameters, "
                  f"{args.microbatches} micro-batches of {args.batch}, median of {args.iters} iterations")
            print(f"{'mode':<12} {'exposed reduction ms':>21} {'iteration ms':>13}")
            print(f"{'at step':<12} {plain[0] * 1e3:>21.1f} {plain[1] * 1e3:>13.1f}")
            print(f"{'overlapped':<12} {over[0] * 1e3:>21.1f} {over[1] * 1e3:>13.1f}   "
                  f"(buckets of {args.bucket_size:,} elements)")
            print(f"overlap fraction 1 - exposed/total = {1 - over[0] / plain[0]:.2f}")
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--bucket-size", type=int, default=600_000, help="elements per bucket when overlapping")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    mp.start_processes(_worker, args=(free_port(), args), nprocs=2, join=True, start_method="spawn")


if __name__ == "__main__":
    main()
