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

import argparse
import dataclasses
import os

from megatron.pipeline.planner.auto_schedule import HOST_CORES_OPTION
from megatron.trainer.launch.host import runs_on_cpu


def pipeline_cores(cores: int, local_ranks: int, stages: int) -> float | None:
    """The cores one pipeline's ``stages`` share when ``local_ranks`` outnumber ``cores``, else None."""
    if local_ranks <= cores:
        return None
    return cores * stages / local_ranks


def apply_auto_host_cores(args: argparse.Namespace) -> float | None:
    """Give an ``auto`` run on a shared CPU host its pipeline's cores (option ``host_cores``)."""
    from megatron.pipeline.schedules import SELECTORS

    run = args.run
    if args.pipeline_schedule not in SELECTORS or run is None or not runs_on_cpu(args) \
            or run.schedule.options.get(HOST_CORES_OPTION) is not None:
        return None
    stages = args.pipeline_model_parallel_size
    ranks = stages * args.data_parallel_size * (args.tensor_model_parallel_size or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
    cores = pipeline_cores(os.cpu_count() or 1, local, stages)
    if cores is None:
        return None
    options = {**run.schedule.options, HOST_CORES_OPTION: cores}
    args.run = dataclasses.replace(run, schedule=dataclasses.replace(run.schedule, options=options))
    return cores
