"""Ranks never outlive the process that started them.

A rank started by our local launcher, or by torchrun's agent, asks the Linux kernel to
SIGKILL it when that parent dies (``prctl(PR_SET_PDEATHSIG)``): a ``kill -9`` of the
launcher, a container stop or an out-of-memory kill then takes the ranks with it instead of
leaving them reparented to init and training on. SIGKILL, not SIGTERM, because a graceful
stop (``--exit-signal-handler``) is what the launcher's *forwarded* signal is for; a parent
that vanished cannot wait for a save.

The request races with the parent's death (it may die between fork and ``prctl``), so the
parent's pid is checked afterwards: a rank whose parent is already gone exits at once.
Elsewhere than Linux this is a no-op (the launcher still forwards signals).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
LAUNCHER_PID_ENV = "MEGATRON_ASYNC_LAUNCHER_PID"


def _set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(expected_parent: int | None) -> None:
    """Make this process die when its parent does; exit now if the parent is already gone.

    ``expected_parent`` is the parent's pid when known (our launcher passes its own); with
    None (torchrun) the current parent is taken, and a parent of 1 means it already died.
    """
    parent = os.getppid() if expected_parent is None else expected_parent
    if not _set_parent_death_signal(signal.SIGKILL):
        return
    if os.getppid() != parent or parent == 1:  # the parent died before the request took effect
        print(f"error: this rank's launcher (pid {parent}) is gone; exiting", file=sys.stderr, flush=True)
        os._exit(1)


def guard_rank_process() -> None:
    """Called first in a rank: tie it to our launcher, or to torchrun's agent.

    Our launcher puts its pid in the environment (exec'd ranks); torchrun marks its workers
    with ``TORCHELASTIC_RUN_ID``. Ranks started by ``srun`` (one task per GPU) are left to
    slurmstepd, which owns and kills its tasks itself.
    """
    if LAUNCHER_PID_ENV in os.environ:
        die_with_parent(int(os.environ[LAUNCHER_PID_ENV]))
    elif "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent(None)


def exit_code_of(returncode: int) -> int:
    """A rank's return code as a shell reports it: killed by signal N -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode
