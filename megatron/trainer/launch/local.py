"""Where a validated run's ranks run: this process (a rank already, or the only rank), or one
process per rank on this machine.

:func:`launch_ranks` starts the local ranks and hands each one the run plan
(:mod:`megatron.trainer.config.plan_file`), so no rank parses argv again. (Every process first
runs :func:`megatron.trainer.launch.entry.enter_process`.)
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.config.plan_file import run_plan_file
from megatron.trainer.launch.exit_control import launcher_signals
from megatron.trainer.launch.host import runs_on_cpu
from megatron.trainer.environment import is_worker_process
from megatron.trainer.launch.launcher import grace_for, launch_local


def launch_ranks(config: RunPlan, command: Sequence[str], run_rank: Callable[[], int]) -> int:
    """Run this process's rank(s) of ``run_rank``; the exit code. In a rank (torchrun's, or one
    our launcher started) and for a lone rank with nothing to restart: here. Otherwise
    ``config.parallel.world_size`` local ranks: forked on CPU (imports already paid), fresh
    ``python *command`` processes on GPU, which read the plan from a file."""
    if is_worker_process():
        return run_rank()
    if config.parallel.world_size == 1 and not config.launch.max_restarts:  # one rank, nothing to restart: run it here
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        return run_rank()
    launch = config.launch
    with run_plan_file(config) as env:
        return launch_local(config.parallel.world_size, list(command), grace_for(launch.pipeline_timeout_seconds),
                            target=run_rank if runs_on_cpu(config) else None,
                            forward_signals=launcher_signals(config), max_restarts=launch.max_restarts, env=env)
