"""``--pipeline-schedule auto`` on a CPU host whose cores the run's ranks outnumber.

Why: with more local ranks than cores (PP = 4 on a 2-core laptop or CI host) the stages
time-share the cores, and a schedule that fills pipeline bubbles gains nothing once the cores
are busy; ``auto`` then ranks candidates with processor sharing
(:mod:`megatron.pipeline.planner.shared_cores`) instead of a device per stage. The cores one
pipeline gets are the host's over its local ranks, times the pipeline's stages: the same number
on every rank (``os.cpu_count()``, the count the trainer's default ``--num-threads`` divides,
not a rank's own affinity mask, which core binding narrows), so every rank makes the same choice.
"""
from __future__ import annotations

import os

from megatron.pipeline.planner.auto_schedule import auto_options
from megatron.trainer.config.job_config import JobConfig, with_schedule_options
from megatron.trainer.launch.host import runs_on_cpu


def pipeline_cores(cores: int, local_ranks: int, stages: int) -> float | None:
    """The cores one pipeline's ``stages`` share when ``local_ranks`` outnumber ``cores``, else None."""
    if local_ranks <= cores:
        return None
    return cores * stages / local_ranks


def apply_auto_host_cores(config: JobConfig) -> JobConfig:
    """Give an ``auto`` run on a shared CPU host its pipeline's cores (option ``host_cores``):
    the config with them."""
    from megatron.pipeline.schedules import SELECTORS

    run = config.run
    if config.schedule.pipeline_schedule not in SELECTORS or run is None or not runs_on_cpu(config) \
            or auto_options(run.schedule.options).host_cores is not None:
        return config
    stages = config.parallel.pipeline_model_parallel_size
    ranks = stages * config.parallel.data_parallel_size * (config.parallel.tensor_model_parallel_size or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
    cores = pipeline_cores(os.cpu_count() or 1, local, stages)
    if cores is None:
        return config
    return with_schedule_options(config, host_cores=cores)
