"""The layer split of the run (``--pipeline-partition``), decided from the flags before any rank
starts: the user's ``--pipeline-layer-split``, a resumed checkpoint's, the balanced default, or
the even split; ``profiled`` is checked here and measured on the ranks
(:mod:`megatron.trainer.tasks.auto_partition`). The flags are declared in
:mod:`megatron.trainer.config.insight_args`; the split needs the cost model and the checkpoint of
the tasks' floor, so it is planned here, above them. The decision is the run plan's
(:class:`~megatron.trainer.config.run_plan.LayerSplit`); the flags stay as the user gave them.
"""
from __future__ import annotations

import argparse
import dataclasses

from megatron.pipeline.schedules import ScheduleConfigError
from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.job_config import TaskOptions, build_job_config
from megatron.trainer.config.run_config import RunConfig
from megatron.trainer.config.run_plan import LayerSplit
from megatron.trainer.tasks.balanced_partition import balanced_split, checkpoint_split, why_not_balanced
from megatron.trainer.tasks.chunk_order_costs import with_chunk_costs


def resolve_partition(args: argparse.Namespace) -> LayerSplit:
    """Check the partition flags and decide the layer split (raise :class:`ConfigError`, one line)."""
    layers = _decided_split(args)
    _plan_from_chunk_costs(args, layers.counts)
    if layers.partition != "profiled":
        return layers
    pp = args.pipeline_model_parallel_size
    if vars(args).get("task_options", TaskOptions).model_family == "synthetic":
        raise ConfigError("--pipeline-partition profiled profiles GPT and BERT layers; this task has none")
    if args.num_layers < pp:
        raise ConfigError(f"--pipeline-partition profiled needs --num-layers {args.num_layers} >= "
                          f"--pipeline-model-parallel-size {pp} (one layer per stage at least)")
    parts = RunConfig.from_args(args).layout.num_model_stages  # chunked layouts: one count per chunk
    if args.num_layers < parts:
        raise ConfigError(f"--pipeline-partition profiled needs --num-layers {args.num_layers} >= the "
                          f"{parts} model chunks of the layout (one layer each at least)")
    if args.pipeline_partition_profile_iters < 1:
        raise ConfigError("--pipeline-partition-profile-iters must be >= 1")
    _, split = checkpoint_split(build_job_config(args))  # resuming: keep the split the weights were saved with
    if split is not None and len(split) in (pp, parts) and sum(split) == args.num_layers:
        return dataclasses.replace(layers, counts=split, resumed=True)
    return layers


def planned_run(args: argparse.Namespace, split: list[int] | None) -> RunConfig:
    """The schedule's config and layout of the flags ``args`` on the layer split ``split``, with
    per-chunk placeholder costs where the split calls for them; raises
    :class:`~megatron.pipeline.schedules.ScheduleConfigError`."""
    run = RunConfig.from_args(args)
    schedule = with_chunk_costs(args, run.schedule, split)
    return run if schedule is run.schedule else dataclasses.replace(run, schedule=schedule)


def _plan_from_chunk_costs(args: argparse.Namespace, split: list[int] | None) -> None:
    """zb-v on a split that gives every V chunk its own count orders its ops from per-chunk
    placeholder costs (:mod:`megatron.trainer.tasks.chunk_order_costs`): the schedule the flag
    checks built before the split was decided is built again with them (as the run plan will
    build it), so a schedule that cannot run them is refused before any rank starts."""
    try:
        run = planned_run(args, split)
        if run.schedule.options != RunConfig.from_args(args).schedule.options:
            run.run_schedule(args.pipeline_schedule)
    except ScheduleConfigError as exc:
        raise ConfigError(f"--pipeline-schedule: {exc}") from None


def _decided_split(args: argparse.Namespace) -> LayerSplit:
    """The partition that applies: ``explicit`` for the user's ``--pipeline-layer-split`` (or
    Megatron-LM's split flags), ``checkpoint`` for a resumed run's, the default ``balanced``
    where it applies, else ``even``; an explicit choice that cannot apply is refused."""
    asked = args.pipeline_partition
    memory = args.pipeline_partition_memory_gb
    source = args.layer_split_source  # the Megatron-LM flags an explicit split came from
    if memory is not None and memory <= 0:
        raise ConfigError("--pipeline-partition-memory-gb must be > 0")
    if args.pipeline_layer_split is not None:
        if asked in ("balanced", "profiled"):
            raise ConfigError(f"--pipeline-partition {asked} chooses the split; drop --pipeline-layer-split")
        layers = LayerSplit(list(args.pipeline_layer_split), "explicit", source)
    elif asked in (None, "balanced"):
        flags = build_job_config(args)  # the split's inputs
        reason = why_not_balanced(flags)
        if reason is not None and asked == "balanced":
            raise ConfigError(f"--pipeline-partition balanced cannot apply: {reason}")
        resumed, split = checkpoint_split(flags) if asked is None and reason is None else (False, None)
        if resumed:  # the default keeps a checkpoint's split (even before the balanced default)
            layers = LayerSplit(split, "checkpoint", source)
        elif reason is None:
            split, feasible = balanced_split(flags)
            layers = LayerSplit(split, "balanced", source, feasible=feasible)
        else:
            layers = LayerSplit(None, "even", source)
    else:  # even, profiled (measured on the ranks)
        layers = LayerSplit(None, asked, source)
    if memory is not None and layers.partition in ("even", "explicit"):
        raise ConfigError("--pipeline-partition-memory-gb needs --pipeline-partition balanced or profiled")
    return layers
