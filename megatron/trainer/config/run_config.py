"""The run's typed configuration, derived once from the validated flags.

``parse_args`` attaches a :class:`RunConfig` as ``args.run``; the driver, the tasks and the
checkpointing read the schedule class, its config and the pipeline layout from there instead
of recomputing them from flags at every call site.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron.pipeline.ir import PipelineLayout
from megatron.pipeline.schedules import ScheduleConfig, schedule_class
from megatron.pipeline.schedules.base import Schedule
from megatron.pipeline.schedules.interleaved import GROUP_OPTION
from megatron.trainer.config.pipemare_args import pipemare_options
from megatron.trainer.config.post_validation_args import post_validation_options
from megatron.trainer.config.zero_bubble_args import zero_bubble_options


@dataclass(frozen=True)
class RunConfig:
    """What the flags decide about the pipeline: schedule, its config, the stage layout."""

    schedule_cls: type[Schedule]
    schedule: ScheduleConfig
    layout: PipelineLayout
    pipeline_size: int
    data_parallel_size: int
    tensor_parallel_size: int

    @property
    def asynchronous(self) -> bool:
        """Whether stages step locally (no pipeline-wide optimizer step)."""
        return self.schedule_cls.asynchronous

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunConfig:
        config = schedule_config(args)
        schedule_cls = schedule_class(args.pipeline_schedule)
        return cls(schedule_cls=schedule_cls, schedule=config, layout=schedule_cls.layout_of(config),
                   pipeline_size=args.pipeline_model_parallel_size,
                   data_parallel_size=args.data_parallel_size,
                   tensor_parallel_size=args.tensor_model_parallel_size)


def schedule_config(args: argparse.Namespace) -> ScheduleConfig:
    """The schedule's config from the flags (its options included)."""
    group = getattr(args, "microbatch_group_size_per_virtual_pipeline_stage", None)
    return ScheduleConfig(
        num_stages=args.pipeline_model_parallel_size,
        num_microbatches=args.num_microbatches,
        num_iterations=args.train_iters,
        num_chunks=getattr(args, "num_model_chunks", 1),
        options={**({} if group is None else {GROUP_OPTION: group}), **zero_bubble_options(args),
                 **post_validation_options(args), **pipemare_options(args)},
    )


def pipeline_layout(args: argparse.Namespace) -> PipelineLayout:
    """Where the run's schedule places model chunks (AMDP: one chunk per replicated pipeline)."""
    return run_config(args).layout


def run_config(args: argparse.Namespace) -> RunConfig:
    """``args.run`` (set by ``parse_args``), or built now for a namespace made another way."""
    run = getattr(args, "run", None)
    return run if isinstance(run, RunConfig) else RunConfig.from_args(args)
