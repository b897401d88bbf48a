"""TESTS ONLY: ``MEGATRON_ASYNC_TEST_KILL_DURING_SAVE=ATTEMPT:ITERATION:RANK:POINT[,...]`` SIGKILLs a rank mid-save.

A ``kill -9`` from outside lands at a random moment of a save that takes milliseconds on a
tiny model; a test of "killed while the stages write" needs it at a named point, every time.
The rank kills *itself* with SIGKILL (no handler, no cleanup: what ``kill -9`` does) at
``POINT`` of the save of ``ITERATION``, in restart attempt ``ATTEMPT`` only
(``TORCHELASTIC_RESTART_COUNT``), so a later attempt saves normally or dies elsewhere:

* ``written``: this rank has written its file into ``iter_*.tmp`` (others may not have);
* ``renamed``: the coordinator has renamed the complete directory into place, but not yet
  replaced the pointer.

Unset (always, outside tests) it costs one environment lookup per save.
"""
from __future__ import annotations

import os
import signal

from megatron.trainer.environment import restart_attempt

KILL_DURING_SAVE_ENV = "MEGATRON_ASYNC_TEST_KILL_DURING_SAVE"
POINTS = ("written", "renamed")


def kill_here_if_asked(point: str, iteration: int) -> None:
    """SIGKILL this process if the variable names this attempt, save, rank and ``point``."""
    spec = os.environ.get(KILL_DURING_SAVE_ENV)
    if not spec:
        return
    here = (restart_attempt(), iteration, int(os.environ.get("RANK", "0")))
    for item in spec.split(","):
        attempt, at, rank, where = item.split(":")
        if where not in POINTS:
            raise ValueError(f"{KILL_DURING_SAVE_ENV}={spec}: POINT must be one of {', '.join(POINTS)}")
        if (int(attempt), int(at), int(rank)) == here and where == point:
            os.kill(os.getpid(), signal.SIGKILL)
