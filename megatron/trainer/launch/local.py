"""Process start-up: one process per rank on this machine (or this process is a rank already).

:func:`enter_process` runs first in every process (Slurm's task variables, the guard that ends
a rank with its launcher); :func:`launch_ranks` starts the local ranks of a validated run and
hands each one the built configuration (:mod:`megatron.trainer.config.job_file`), so no rank
parses argv again.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from megatron.trainer.config.job_config import JobConfig
from megatron.trainer.config.job_file import job_config_file
from megatron.trainer.launch.exit_control import launcher_signals
from megatron.trainer.launch.host import runs_on_cpu
from megatron.trainer.environment import is_worker_process
from megatron.trainer.launch.launcher import grace_for, launch_local
from megatron.trainer.launch.process_guard import guard_rank_process
from megatron.trainer.launch.slurm_env import SlurmEnvironmentError, adopt_slurm_task_environment


def enter_process() -> int | None:
    """Adopt srun's task environment (one task per GPU: each task is a rank) and, in a rank,
    die with the launcher; an exit code where the environment is unusable."""
    try:
        adopt_slurm_task_environment()
    except SlurmEnvironmentError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    if is_worker_process():
        guard_rank_process()  # dies with our launcher or torchrun's agent
    return None


def launch_ranks(config: JobConfig, command: Sequence[str], run_rank: Callable[[], int]) -> int:
    """Run ``config.parallel.world_size`` local ranks of ``run_rank``: forked on CPU (imports already
    paid), fresh ``python *command`` processes on GPU, which read ``args`` from a file."""
    launch = config.launch
    with job_config_file(config) as env:
        return launch_local(config.parallel.world_size, list(command), grace_for(launch.pipeline_timeout_seconds),
                            target=run_rank if runs_on_cpu(config) else None,
                            forward_signals=launcher_signals(config), max_restarts=launch.max_restarts, env=env)
