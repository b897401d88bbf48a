"""The layer split of the run (``--pipeline-partition``), decided from the flags before any rank
starts: the user's ``--pipeline-layer-split``, a resumed checkpoint's, the balanced default, or
the even split; ``profiled`` is checked here and measured on the ranks
(:mod:`megatron.trainer.tasks.auto_partition`). The flags are declared in
:mod:`megatron.trainer.config.insight_args`; the split needs the cost model and the checkpoint of
the tasks' floor, so it is planned here, above them.
"""
from __future__ import annotations

import argparse

from megatron.pipeline.schedules import ScheduleConfigError
from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.job_config import TaskOptions, build_job_config
from megatron.trainer.config.run_config import RunConfig
from megatron.trainer.plan.build import planned_run
from megatron.trainer.tasks.balanced_partition import balanced_split, checkpoint_split, why_not_balanced


def resolve_partition(args: argparse.Namespace) -> None:
    """Check the partition flags and decide the balanced split (sets ``args.pipeline_partition``
    to what applies, and ``args.pipeline_layer_split`` when balancing moves layers)."""
    _resolve_partition(args)
    _plan_from_chunk_costs(args)
    if args.pipeline_partition != "profiled":
        return
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
        args.pipeline_layer_split = split
        args.pipeline_partition_resumed = True


def _plan_from_chunk_costs(args: argparse.Namespace) -> None:
    """zb-v on a split that gives every V chunk its own count orders its ops from per-chunk
    placeholder costs (:mod:`megatron.trainer.tasks.chunk_order_costs`): the schedule the flag
    checks built before the split was decided is built again with them (as the run plan will
    build it), so a schedule that cannot run them is refused before any rank starts."""
    try:
        run = planned_run(args)
        if run.schedule.options != RunConfig.from_args(args).schedule.options:
            run.run_schedule(args.pipeline_schedule)
    except ScheduleConfigError as exc:
        raise ConfigError(f"--pipeline-schedule: {exc}") from None


def _resolve_partition(args: argparse.Namespace) -> None:
    """The partition that applies: ``explicit`` for the user's ``--pipeline-layer-split``,
    ``checkpoint`` for a resumed run's, the default ``balanced`` where it applies, else ``even``;
    an explicit choice that cannot apply is refused."""
    asked = args.pipeline_partition
    memory = args.pipeline_partition_memory_gb
    if memory is not None and memory <= 0:
        raise ConfigError("--pipeline-partition-memory-gb must be > 0")
    if args._balanced_split:  # checked before: decide again from the flags
        args.pipeline_layer_split, asked = None, "balanced"
    if args.pipeline_layer_split is not None:
        if asked in ("balanced", "profiled"):
            raise ConfigError(f"--pipeline-partition {asked} chooses the split; drop --pipeline-layer-split")
        args.pipeline_partition = "explicit"
    elif asked in (None, "balanced"):
        flags = build_job_config(args)  # the split's inputs (none of them is set below)
        reason = why_not_balanced(flags)
        if reason is not None and asked == "balanced":
            raise ConfigError(f"--pipeline-partition balanced cannot apply: {reason}")
        args.pipeline_partition = "even" if reason is not None else "balanced"
        resumed, split = checkpoint_split(flags) if asked is None and reason is None else (False, None)
        if resumed:  # the default keeps a checkpoint's split (even before the balanced default)
            args.pipeline_layer_split, args.pipeline_partition = split, "checkpoint"
        elif reason is None:
            split, args.pipeline_partition_feasible = balanced_split(flags)
            if split is not None:
                args.pipeline_layer_split = split
                args._balanced_split = True  # not the user's: a second check of the flags decides it again
    if memory is not None and args.pipeline_partition in ("even", "explicit"):
        raise ConfigError("--pipeline-partition-memory-gb needs --pipeline-partition balanced or profiled")
