"""The schedules' own flags on the command line, and the checks every schedule shares.

Each schedule class declares its flags (``traits.flag_groups``, :mod:`megatron.pipeline.schedules.options`);
this module adds those of every registered schedule to the parser, each group once, and refuses
with one line a flag the chosen schedule does not take. It compares no schedule names: which
schedule takes what is read from the registry, so a new schedule needs no edit here.
"""
from __future__ import annotations

import argparse

from megatron.pipeline.schedules import (
    ScheduleConfigError, chunked_schedules, flag_groups, schedule_class)
from megatron.pipeline.ir import PipelineLayout, VShapeLayout
from megatron.pipeline.schedules.base import Schedule
from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.run_config import schedule_config


def add_schedule_args(parser: argparse.ArgumentParser) -> None:
    """One argument group per flag group, titled with the schedules that take it."""
    for group, takers in flag_groups().items():
        g = parser.add_argument_group(f"{group.title} ({', '.join(takers)})")
        for flag in group.flags:
            g.add_argument(flag.name, **flag.argparse_kwargs())


def chosen_schedule(args: argparse.Namespace) -> type[Schedule]:
    """The class of ``--pipeline-schedule`` (one-line :class:`ConfigError` for an unknown name)."""
    try:
        return schedule_class(args.pipeline_schedule)
    except ScheduleConfigError as exc:
        raise ConfigError(f"--pipeline-schedule: {exc}") from None


def check_schedule_flags(args: argparse.Namespace) -> None:
    """Refuse a schedule flag the chosen schedule does not take, chunks it cannot run, and flag
    values its options cannot use (one line each, before any rank starts)."""
    cls, name = chosen_schedule(args), args.pipeline_schedule
    for group, takers in flag_groups().items():
        given = group.given(args)
        if given and group not in cls.traits.flag_groups:
            which = (f"{group.requirement} --pipeline-schedule ({', '.join(takers)})" if group.requirement
                     else f"--pipeline-schedule {' or '.join(takers)}")
            raise ConfigError(f"{given[0].name} needs {which}; got {name}")
    _check_model_chunks(args, cls)
    try:
        config = schedule_config(args)  # the options from the flags: their values are checked here
    except ScheduleConfigError as exc:
        raise ConfigError(str(exc)) from None
    _check_part_split(args, cls.traits.layout_of(config))


def _check_part_split(args: argparse.Namespace, layout: PipelineLayout) -> None:
    """The layers of every model part of the schedule's layout: a V halves each stage's
    ``--pipeline-layer-split`` count between its two chunks, and splits evenly into 2 PP parts
    without one (other layouts are checked with the flags they take)."""
    try:
        split = layout.part_layer_split(args.pipeline_layer_split)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    parts = layout.num_model_stages
    if isinstance(layout, VShapeLayout) and split is None and args.pipeline_layer_split is None \
            and args.num_layers % parts and args.pipeline_partition != "balanced":
        raise ConfigError(
            f"--num-layers {args.num_layers} does not split evenly into the {parts} model parts of "
            f"--pipeline-schedule {args.pipeline_schedule} (or pass --pipeline-layer-split or --pipeline-partition balanced)")


def _check_model_chunks(args: argparse.Namespace, cls: type[Schedule]) -> None:
    """``--num-layers-per-virtual-pipeline-stage``: an even layer split into whole chunks, and
    more than one chunk per stage only for a schedule that runs chunks (whether a schedule
    needs them is its own check)."""
    pp, per_chunk = args.pipeline_model_parallel_size, args.num_layers_per_virtual_pipeline_stage
    flag = "--num-layers-per-virtual-pipeline-stage"
    if per_chunk is None:
        return
    if per_chunk < 1:
        raise ConfigError(f"{flag} must be >= 1")
    if args.pipeline_layer_split is not None:
        raise ConfigError(f"{flag} needs an even layer split; drop --pipeline-layer-split")
    if args.num_layers % (pp * per_chunk):
        raise ConfigError(
            f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
            f"{flag} {per_chunk}")
    if args.num_model_chunks > 1 and not cls.traits.takes_model_chunks:
        raise ConfigError(
            f"{flag} {per_chunk} gives {args.num_model_chunks} model chunks per stage, which only "
            f"--pipeline-schedule {' or '.join(chunked_schedules())} runs (not {args.pipeline_schedule})")
