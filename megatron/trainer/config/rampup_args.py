"""``--rampup-batch-size``: the global batch of every iteration, from megatron-core's calculator.

Megatron-LM grows the global batch from START by INCREMENT every SAMPLES / ((GBS - START) /
INCREMENT) consumed samples (``RampupBatchsizeNumMicroBatchesCalculator``). We ask that
calculator, iteration by iteration, for the batch of each iteration, so the numbers are
megatron-core's own.

What a rampup means for a pipeline schedule: the accumulation ``a`` (micro-batches per
update) changes over time. Every schedule here is built for a fixed ``a``, and every
asynchronous one (1F1B-async, 2BW, PipeMare, ...) streams micro-batches across update
boundaries. So the run is cut into segments of constant ``a`` (like evaluation or checkpoint
boundaries: each segment ends drained, asynchronous schedules fill and drain once per
segment) and each segment runs the schedule built for its ``a``. A schedule that cannot run
some ``a`` of the ramp (too few micro-batches for its stages, AMDP's split over pipelines,
interleaving's groups) is refused up front with one line naming the batch.

Schedules whose per-stage state is built for one ``a`` (PipeDream-2BW's weight double
buffer, PipeMare's delay-based correction and learning rate) or whose plan comes from costs
profiled once (zb-1p, zb-2p) are refused with one line.

Megatron-LM itself refuses a rampup with ``--train-iters`` (it wants ``--train-samples``);
we allow both: with ``--train-iters`` the run is that many (ramping) iterations. The learning
rate counts updates, not samples (see :mod:`megatron.trainer.config.megatron_compat_args`).

This module is the parse-time half (the plan and its checks); :mod:`megatron.trainer.loop.rampup`
builds each segment's schedule while the run goes.
"""
from __future__ import annotations

import argparse
import dataclasses

from megatron.pipeline.schedules import SCHEDULES, ScheduleConfig, ScheduleConfigError, ScheduleOptions, schedule_class
from megatron.pipeline.schedules.base import Schedule
from megatron.pipeline.schedules.zero_bubble.flags import profile_iterations
from megatron.trainer.config.batch_plan import BatchPlan
from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.run_config import schedule_config



def batch_plan(args: argparse.Namespace) -> BatchPlan:
    """The run's plan: megatron-core's calculator asked before every iteration (constant
    ``--global-batch-size`` without a rampup)."""
    if args.rampup_batch_size is None:
        return BatchPlan((), args.global_batch_size)
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    start, increment, samples = args.rampup_batch_size
    final = args.global_batch_size
    if start < 1 or increment < 1 or samples < 0:
        raise ConfigError("--rampup-batch-size needs START >= 1, INCREMENT >= 1, SAMPLES >= 0")
    if start > final or (final - start) % increment:
        raise ConfigError(f"--rampup-batch-size: --global-batch-size {final} minus START {start} must be a "
                          f"non-negative multiple of INCREMENT {increment}")
    calculator = RampupBatchsizeNumMicroBatchesCalculator(
        final, args.micro_batch_size, args.data_parallel_size, False, 0, start, increment, samples)
    ramp: list[int] = []
    consumed = 0
    while True:
        calculator.update(consumed, consistency_check=False)
        batch = calculator.get_current_global_batch_size()
        if batch == final and consumed > samples:
            return BatchPlan(tuple(ramp), final)
        ramp.append(batch)
        consumed += batch


def check_rampup_flags(args: argparse.Namespace) -> None:
    """Every batch of the ramp splits into micro-batches, and the schedule runs each ``a``."""
    if args.rampup_batch_size is None:
        return
    cls = schedule_class(args.pipeline_schedule)
    config = schedule_config(args)
    fixed = _built_for_one_accumulation(cls, config)
    if profile_iterations(config.options):
        fixed = "plans from costs profiled once at the run's start (pass --zb-costs and --zb-profile-iters 0)"
    if fixed:
        ramping = [name for name, other in SCHEDULES.items() if _built_for_one_accumulation(other, config) is None]
        raise ConfigError(f"--rampup-batch-size: {args.pipeline_schedule} {fixed}, which a rampup changes "
                          f"({', '.join(ramping)} ramp)")
    per_microbatch = args.micro_batch_size * args.data_parallel_size
    plan = batch_plan(args)

    for batch in sorted(set(plan.ramp[:args.train_iters])):
        if batch % per_microbatch:
            raise ConfigError(f"--rampup-batch-size: global batch {batch} of the ramp is not divisible by "
                              f"--micro-batch-size {args.micro_batch_size} x data-parallel size "
                              f"{args.data_parallel_size}")
        config = dataclasses.replace(schedule_config(args), num_microbatches=batch // per_microbatch)
        try:
            cls.check_config(config)
        except ScheduleConfigError as exc:
            raise ConfigError(f"--rampup-batch-size: global batch {batch} of the ramp: {exc}") from None


def _built_for_one_accumulation(cls: type[Schedule], config: ScheduleConfig) -> str | None:
    """Why ``cls`` cannot change its accumulation mid-run (None: it can, segment by segment).

    Weight policies (2BW's double buffer, PipeMare's delay and correction) and per-stage
    learning-rate rules are built once per stage from the run's ``a``; the schedule's policy
    says so (``fixed_accumulation``), whatever its options (the run's are another schedule's).
    """
    return cls.traits.policy_for(dataclasses.replace(config, options=ScheduleOptions())).fixed_accumulation
