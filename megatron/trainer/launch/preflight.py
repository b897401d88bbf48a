"""The up-front checks of a launch, before any rank starts (module docstrings of the checks)."""
from __future__ import annotations

import sys

from megatron.trainer.checkpointing.load import check_resume_or_exit
from megatron.trainer.config.arguments import build_parser
from megatron.trainer.plan.parse import parse_args
from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.job_config import JobConfig, build_job_config
from megatron.trainer.config.job_file import handed_config
from megatron.trainer.launch.auto_cores import apply_auto_host_cores
from megatron.trainer.launch.auto_memory import apply_auto_memory_limit
from megatron.trainer.launch.auto_relayout import apply_auto_relayouts, start_in_chosen_layout
from megatron.trainer.launch.host import runs_on_cpu
from megatron.trainer.environment import is_worker_process
from megatron.trainer.launch.memory_check import check_memory
from megatron.trainer.launch.schedule_check import check_schedule
from megatron.trainer.tasks.task import PretrainTask


def preflight(task: PretrainTask, argv: list[str]) -> JobConfig:
    """Every up-front check of a launch: flags, data, tokenizer, paths, (outside a rank) the
    checkpoint's files, the memory estimate and a replay of the schedule's first iterations;
    exits with status 2 and one ``error:`` line on the first problem. A rank our launcher
    started takes the launcher's configuration and runs only its own device's checks."""
    config = handed_config() if is_worker_process() else None
    if config is None:
        parser = build_parser(f"Megatron-Async {task.name} pretraining")
        task.add_arguments(parser)
        config = build_job_config(parse_args(argv, parser))
    if not is_worker_process():  # a bad checkpoint fails here, before any rank starts
        check_resume_or_exit(task, config)
    try:  # a run that cannot fit memory, or whose schedule deadlocks: refused here, not inside a rank
        config = check_memory(config, is_worker_process(), not runs_on_cpu(config))
        config = apply_auto_memory_limit(config)  # auto: the memory left after the check bounds its choice
        config = apply_auto_host_cores(config)  # auto on a CPU host with more ranks than cores: shared cores
        if not is_worker_process():  # auto: the layouts it may rebuild in (from this command line)
            config = start_in_chosen_layout(task, apply_auto_relayouts(task, config, argv))
        check_schedule(config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    return config
