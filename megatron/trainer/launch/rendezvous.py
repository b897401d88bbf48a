"""The key-value store a rank's process groups meet through: a fresh namespace per restart.

Why not ``init_process_group("gloo")`` with its default ``env://``: under torchrun the store is
the *agent's* TCPStore (``TORCHELASTIC_USE_AGENT_STORE``), and with the static and c10d
rendezvous the agent keeps that one store for every restart of its workers. ``env://`` adds
no per-attempt prefix (torch assumes a new store per retry), so the restarted workers find
the dead attempt's keys still there: gloo's ``connectFullMesh`` reads each peer's address
from keys under the group's name (``default_pg/0/...``, and for ``new_group`` names that
repeat, since group names count from 0 in every process) and gets the *old* process's
address if it looks before the new peer has overwritten it. It then connects to a closed port ("Connection refused")
and the attempt dies -- or not, depending on which process got there first.

Here every rank builds the store itself, wrapped in a :class:`~torch.distributed.PrefixStore`
named after the restart attempt (torchrun's ``TORCHELASTIC_RESTART_COUNT``; our launcher sets
the same variable), so every key of an attempt -- the default group's, every ``new_group``'s,
every store barrier's -- is new; nothing depends on timing. Who hosts the store: torchrun's
agent when it says so, otherwise rank 0 (our launcher, ``srun`` one task per rank), as
``env://`` does.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist


from megatron.trainer.environment import restart_attempt

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


def attempt_prefix(env: Mapping[str, str] | None = None) -> str:
    """The namespace of this attempt's keys (the run id too: one agent store, several runs)."""
    env = os.environ if env is None else env
    return f"megatron-async/{env.get('TORCHELASTIC_RUN_ID', 'local')}/attempt{restart_attempt(env)}"


def rank_store(rank: int, world_size: int, timeout: timedelta,
               env: Mapping[str, str] | None = None) -> dist.Store:
    """This rank's connection to the run's TCPStore at ``MASTER_ADDR:MASTER_PORT``, prefixed
    by :func:`attempt_prefix`. Rank 0 hosts the store unless torchrun's agent already does."""
    env = os.environ if env is None else env
    agent_hosts = env.get(AGENT_STORE_ENV) == str(True)
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_hosts, timeout=timeout)
    return dist.PrefixStore(attempt_prefix(env), store)
