"""The process environment a rank reads, as torchrun defines it (the trainer's ground floor).

Config checks, checkpoint fault injection, the launcher and the restart report all ask the
same questions of ``os.environ`` (am I a rank? which restart is this? how many processes?);
the names and their readers live here, below every package that asks, so none of them has to
import the launcher to learn a variable's name.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"  # torchrun's; our launcher sets it as well
MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"
#: set by our local launcher in every rank it starts (not by torchrun)
LAUNCHED_ENV = "MEGATRON_ASYNC_LAUNCHED"


def restart_attempt(env: Mapping[str, str] | None = None) -> int:
    """Which start of the workers this is: 0 first, k after k restarts."""
    env = os.environ if env is None else env
    return int(env.get(RESTART_COUNT_ENV, "0") or 0)


def is_worker_process() -> bool:
    """True inside torchrun or one of our own spawned ranks."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def world_size_from_env() -> int | None:
    """``WORLD_SIZE`` under torchrun or our launcher; None outside a rank."""
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
