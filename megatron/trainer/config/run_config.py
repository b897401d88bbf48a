"""The run's schedule and stage layout, derived from the checked flags.

The run plan holds the run's :class:`RunConfig` (``plan.run``,
:func:`megatron.trainer.plan.build.build_run_plan`); the driver, the tasks and the
checkpointing read the schedule class, its config and the pipeline layout from there instead
of recomputing them from flags at every call site. The flag checks build their own from the
namespace they check. The schedule's options come from its own flags
(``Schedule.traits.flag_groups``): nothing here knows a schedule by name.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from collections.abc import Mapping

from megatron.pipeline.ir import PipelineLayout
from megatron.pipeline.schedules import ScheduleConfig, build_schedule, schedule_class
from megatron.pipeline.schedules.base import Schedule
from megatron.trainer.config.values import FlagValue

# Optimizers whose state is element-wise, so a schedule may shard it over stage replicas by
# ranges of elements (basis rotation rotates whole matrices, Muon orthogonalises them; the
# sharded path is AdamW's, which delay-nesterov's NAdam shares).
SHARDABLE_OPTIMIZERS = ("adamw", "delay-nesterov")


@dataclass(frozen=True)
class RunConfig:
    """What the flags decide about the pipeline: schedule, its config, the stage layout."""

    schedule_cls: type[Schedule]
    schedule: ScheduleConfig
    layout: PipelineLayout
    pipeline_size: int
    data_parallel_size: int
    tensor_parallel_size: int
    #: each stage replica's optimizer keeps only its share of the state (the schedule decides)
    shards_optimizer_state: bool = False

    def run_schedule(self, name: str) -> Schedule:
        """A new schedule ``name`` of this config (raises
        :class:`~megatron.pipeline.schedules.ScheduleConfigError`). The config keeps no built
        schedule: a schedule is a live object that records what it decides while running, and each
        user (the flag checks, the schedule check, the run) builds its own; building the largest
        searched orders takes a fraction of a second."""
        return build_schedule(name, self.schedule)

    @property
    def asynchronous(self) -> bool:
        """Whether stages step locally (no pipeline-wide optimizer step)."""
        return self.schedule_cls.traits.asynchronous

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunConfig:
        """Raises :class:`~megatron.pipeline.schedules.ScheduleConfigError` (one line)."""
        config = schedule_config(args)
        schedule_cls = schedule_class(args.pipeline_schedule)
        shardable = args.optimizer in SHARDABLE_OPTIMIZERS
        policy = schedule_cls.traits.policy_for(config)
        return cls(schedule_cls=schedule_cls, schedule=config, layout=policy.layout,
                   pipeline_size=args.pipeline_model_parallel_size,
                   data_parallel_size=args.data_parallel_size,
                   tensor_parallel_size=args.tensor_model_parallel_size,
                   shards_optimizer_state=policy.optimizer_sharding.decide(shardable))


def schedule_flag_values(args: argparse.Namespace, schedule_cls: type[Schedule]) -> dict[str, FlagValue]:
    """The values of ``schedule_cls``'s own flags, by ``dest`` (defaults where ``args`` lacks one)."""
    return {dest: value for group in schedule_cls.traits.flag_groups for dest, value in group.values(args).items()}


def schedule_config(args: argparse.Namespace) -> ScheduleConfig:
    """The schedule's config from the flags (its options included); raises
    :class:`~megatron.pipeline.schedules.ScheduleConfigError` for option values it cannot use."""
    schedule_cls = schedule_class(args.pipeline_schedule)
    return schedule_config_of(schedule_cls, args.pipeline_model_parallel_size, args.num_microbatches, args.train_iters,
                            args.num_model_chunks, args.data_parallel_size, schedule_flag_values(args, schedule_cls))


def schedule_config_of(schedule_cls: type[Schedule], stages: int, microbatches: int, iterations: int, chunks: int,
                       data_parallel: int | None, flags: Mapping[str, FlagValue]) -> ScheduleConfig:
    base = ScheduleConfig(num_stages=stages, num_microbatches=microbatches, num_iterations=iterations,
                          num_chunks=chunks, data_parallel_size=data_parallel or 1)
    return dataclasses.replace(base, options=schedule_cls.traits.options_from_flags(flags, base))
