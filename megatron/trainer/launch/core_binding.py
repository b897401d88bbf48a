"""Bind each CPU rank to its own cores (``--bind-cores``).

Why: the ranks of a CPU run each compute on their own threads, and gloo adds a few more per
rank. Left to the scheduler, a rank's threads move between cores and refill their caches each
time; pinned, each rank keeps its cores' caches warm. Measured on the speed issue's workload
(2 CPU ranks on 2 cores, docs/benchmarks_history.md): 1-3 % more tokens/s.

When ``auto`` binds: the device is the CPU, the process may run on every core of the machine
(nobody bound it already: ``srun --cpu-bind``, ``taskset``, ``numactl`` or a container's
cpuset leave a smaller mask, which is then respected as it is), and there are at least as many
cores as local ranks. Local rank ``r`` of ``n`` then gets the ``r``-th of ``n`` equal runs of
consecutive cores (``k = cores // n`` each; cores left over stay unused). It must happen before
the process starts any thread (torch's pool, gloo's), because threads inherit their creator's
mask and an existing thread keeps its own: ``prepare_host`` runs it first.

Several runs on one machine (a test session, two experiments on a workstation) must not pin
their ranks onto the same cores while others idle: a binding rank first claims its cores with
an exclusive ``flock`` on one lock file per core (in ``/dev/shm``, else the temp directory),
held until the process exits (the kernel drops it then, even after a crash). A rank whose
cores another live rank holds is not bound, and the scheduler places it as before (without the
claims, two runs would both pin their local rank 0 to the first core while other cores idle).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import IO

from megatron.trainer.config.choices import BindCores


_held: list[IO[bytes]] = []  # this process's core claims, open (and locked) until it exits


def claim_dir() -> Path:
    """Where the per-core lock files live (shared by every run on the machine)."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def claim_cores(cores: list[int], where: Path | None = None) -> bool:
    """Take an exclusive claim on each of ``cores`` for the life of this process; on the first
    core another process holds, give back what was taken and return False."""
    import fcntl

    where = where or claim_dir()
    taken: list[IO[bytes]] = []
    for core in cores:
        handle = open(where / f"megatron-async-core-{core}.lock", "ab")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            for other in taken:
                other.close()  # closing drops the lock
            return False
        taken.append(handle)
    _held.extend(taken)
    return True


def cores_for_rank(allowed: list[int], local_rank: int, local_processes: int) -> list[int]:
    """Local rank ``local_rank``'s share of ``allowed`` (sorted core ids): its run of
    ``len(allowed) // local_processes`` consecutive cores."""
    per_rank = len(allowed) // local_processes
    if per_rank < 1 or not 0 <= local_rank < local_processes:
        raise ValueError(f"cannot give local rank {local_rank} of {local_processes} its own cores "
                         f"out of {len(allowed)}")
    return allowed[local_rank * per_rank:(local_rank + 1) * per_rank]


def bind_cores(policy: BindCores, on_cpu: bool, local_rank: int, local_processes: int) -> str:
    """Apply ``policy`` to this process; return what it did, for the banner."""
    if policy == "none":
        return "none"
    if not hasattr(os, "sched_setaffinity"):
        return "none (this platform cannot bind)"
    if not on_cpu:
        return "none (the device is not the CPU)"
    allowed = sorted(os.sched_getaffinity(0))
    machine = os.cpu_count() or len(allowed)
    if len(allowed) < machine:
        return f"none (already bound to {len(allowed)} of {machine} cores)"
    if local_processes > len(allowed):
        return f"none ({local_processes} local ranks on {len(allowed)} cores)"
    cores = cores_for_rank(allowed, local_rank, local_processes)
    if not claim_cores(cores):
        return f"none (another run's rank holds {_named(cores)})"
    os.sched_setaffinity(0, cores)
    return f"{len(cores)} of {len(allowed)} cores per local rank (local rank {local_rank}: {_named(cores)})"


def _named(cores: list[int]) -> str:
    """``core 3`` or ``cores 2-3`` (a run of consecutive cores)."""
    return f"cores {cores[0]}-{cores[-1]}" if len(cores) > 1 else f"core {cores[0]}"
