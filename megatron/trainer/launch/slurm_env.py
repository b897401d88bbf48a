"""``srun`` with one task per GPU: each Slurm task is a rank, not a launcher.

torchrun gives a rank RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Under
``srun --ntasks-per-node=G python pretrain_gpt.py ...`` there is no torchrun, and without this
every task would read no RANK, think it is a launcher and start its own ranks. Slurm's
per-task variables say the same thing under other names, so they are translated, unless
torchrun's are present (torchrun inside an srun step keeps its own). MASTER_ADDR is the first
host of the job's node list (``scontrol show hostnames``, as the batch scripts do) and
MASTER_PORT derives from the job id, the same on every task.

Only a job *step* with more than one task is taken as one-task-per-rank: a batch script's
own shell (no step id) or a single-task step runs the local launcher as before.
"""
from __future__ import annotations

import os
import re
import subprocess
from collections.abc import MutableMapping


class SlurmEnvironmentError(RuntimeError):
    """The srun step's variables do not describe a launch; one line for the user."""


def is_srun_rank(env: MutableMapping[str, str]) -> bool:
    """A task of an srun step with several tasks and no torchrun around it."""
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    return in_step and "RANK" not in env and "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list, expanded by ``scontrol show hostnames``."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=60, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError) as exc:
        raise SlurmEnvironmentError(f"cannot expand SLURM_JOB_NODELIST={nodelist} with scontrol ({exc}); "
                                    "set MASTER_ADDR") from None
    if not out:
        raise SlurmEnvironmentError(f"scontrol show hostnames {nodelist} printed no host; set MASTER_ADDR")
    return out[0]


def tasks_on_this_node(env: MutableMapping[str, str]) -> str:
    """SLURM_NTASKS_PER_NODE, or this node's count from SLURM_TASKS_PER_NODE (e.g. ``4(x2),3``)."""
    if "SLURM_NTASKS_PER_NODE" in env:
        return env["SLURM_NTASKS_PER_NODE"]
    counts: list[int] = []
    for part in env.get("SLURM_TASKS_PER_NODE", "").split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m:
            counts += [int(m[1])] * int(m[2] or 1)
    node = int(env.get("SLURM_NODEID", "0"))
    return str(counts[node]) if node < len(counts) else env["SLURM_NTASKS"]


def adopt_slurm_task_environment(env: MutableMapping[str, str] | None = None) -> bool:
    """Set torchrun's variables from Slurm's when this process is an srun rank; True if it is."""
    env = os.environ if env is None else env
    if not is_srun_rank(env):
        return False
    env.setdefault("MASTER_ADDR", first_host(env["SLURM_JOB_NODELIST"]) if "SLURM_JOB_NODELIST" in env
                   else "127.0.0.1")
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_NTASKS"],
               LOCAL_RANK=env.get("SLURM_LOCALID", "0"), LOCAL_WORLD_SIZE=tasks_on_this_node(env))
    return True
