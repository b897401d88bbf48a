"""What every process of a run does first, before it reads a flag: adopt srun's task
environment (one task per GPU: each task is a rank) and, in a rank, die with its launcher."""
from __future__ import annotations

import sys

from megatron.trainer.environment import is_worker_process
from megatron.trainer.launch.process_guard import guard_rank_process
from megatron.trainer.launch.slurm_env import SlurmEnvironmentError, adopt_slurm_task_environment


def enter_process() -> int | None:
    """Adopt srun's task environment and, in a rank, die with the launcher; an exit code where
    the environment is unusable."""
    try:
        adopt_slurm_task_environment()
    except SlurmEnvironmentError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    if is_worker_process():
        guard_rank_process()  # dies with our launcher or torchrun's agent
    return None
