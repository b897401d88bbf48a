"""The run plan, built once from the checked flags (:class:`~megatron.trainer.config.run_plan.RunPlan`).

The flags are parsed and checked first (:mod:`megatron.trainer.plan.parse`); this derives what
the run reads besides them: the schedule's config and the stage layout, with zb-v's per-chunk
placeholder costs where the layer split gives its V chunks different sizes
(:mod:`megatron.trainer.tasks.chunk_order_costs`). The launch's checks then add the memory
estimate (:mod:`megatron.trainer.launch.memory_check`) and ``auto`` its layouts
(:mod:`megatron.trainer.loop.auto`), each as a new plan.
"""
from __future__ import annotations

import argparse
import dataclasses

from megatron.trainer.config.job_config import build_job_config
from megatron.trainer.config.run_config import RunConfig
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.tasks.chunk_order_costs import with_chunk_costs


def planned_run(args: argparse.Namespace) -> RunConfig:
    """The schedule's config and layout of the flags ``args``, with per-chunk costs where the
    split calls for them; raises :class:`~megatron.pipeline.schedules.ScheduleConfigError`."""
    run = RunConfig.from_args(args)
    schedule = with_chunk_costs(args, run.schedule)
    return run if schedule is run.schedule else dataclasses.replace(run, schedule=schedule)


def build_run_plan(args: argparse.Namespace, ignore: tuple[str, ...] = ()) -> RunPlan:
    """The plan of the checked flags ``args`` (``ignore``: a tool's own flags on top of the
    trainer's, as :func:`~megatron.trainer.config.job_config.build_job_config` takes them)."""
    return RunPlan(build_job_config(args, ignore), planned_run(args))
