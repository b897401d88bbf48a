"""Run a function on two spawned gloo ranks of one process group (CPU collectives in tests).

Why a helper: a test of a collective needs real ranks, and every such test repeats the same
set-up (one thread per rank, a fresh rendezvous, the group torn down however the check
ends). The rendezvous is a file store in a fresh temporary directory, not a probed TCP port: a
free port can be taken by a parallel test before rank 0 binds it (EADDRINUSE seen under xdist). ``fn(rank, *args)`` must be picklable (a module-level function). No hang: the group's
collectives time out after ``timeout`` and a rank that raises makes the join raise and end the
other rank.
"""
from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def _rank(rank: int, store_file: str, timeout_s: float, fn: Callable[..., None], args: tuple[Any, ...],
          world_size: int = 2) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def run_on_two_gloo_ranks(fn: Callable[..., None], *args: Any, timeout_s: float = 60) -> None:
    """``fn(rank, *args)`` on ranks 0 and 1 of a gloo group; raises if either raises."""
    run_on_gloo_ranks(fn, *args, world_size=2, timeout_s=timeout_s)


def run_on_gloo_ranks(fn: Callable[..., None], *args: Any, world_size: int, timeout_s: float = 60) -> None:
    """``fn(rank, *args)`` on every rank of a gloo group of ``world_size``; raises if one raises."""
    directory = tempfile.mkdtemp(prefix="gloo_ranks_")
    try:
        mp.start_processes(_rank, args=(os.path.join(directory, "store"), timeout_s, fn, args, world_size),
                           nprocs=world_size, join=True, start_method="spawn")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
