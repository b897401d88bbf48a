"""``--rampup-batch-size`` at run time: the schedule of every segment of constant accumulation.

The plan (the global batch of every iteration) and its checks are made when the flags are
parsed (:mod:`megatron.trainer.config.rampup_args`, which explains the segments); here each
segment gets the schedule built for its ``a``, and the workers read the right data.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from megatron.pipeline.schedules import build_schedule
from megatron.pipeline.schedules.base import Schedule
from megatron.pipeline.runtime.worker import StageWorker
from megatron.trainer.config.run_plan import RunPlan


def segment_boundaries(config: RunPlan) -> list[int]:
    """Iterations where the batch changes (a segment must end there)."""
    return config.batch.changes(config.training.train_iters)


def microbatches_before(config: RunPlan, iteration: int) -> int:
    """Micro-batches per data-parallel replica consumed by iterations ``[0, iteration)``."""
    training = config.training
    return config.batch.consumed_before(iteration) // (training.micro_batch_size * config.parallel.data_parallel_size)


def segment_schedules(config: RunPlan, base: Schedule,
                      workers: Sequence[StageWorker]) -> Callable[[int, int], Schedule] | None:
    """``(first, count) -> schedule`` of a segment, and the workers set up for it.

    None without a rampup (the loop restricts the run's schedule to each segment). With one,
    the schedule built for the segment's accumulation ``a``: its micro-batch ``first * a + j``
    reads data micro-batch ``microbatches_before(first) + j``, and losses are scaled by
    ``1 / a``. Each segment continues the previous segment's schedule of the same ``a``, so
    what a schedule decides while running carries over, as without a rampup.
    """
    if config.training.rampup_batch_size is None:
        return None
    data = [w.setup.batch_fn for w in workers]
    built: dict[int, Schedule] = {}
    per_microbatch = config.training.micro_batch_size * config.parallel.data_parallel_size

    def schedule_for(first: int, count: int) -> Schedule:
        a = config.batch.global_batch(first) // per_microbatch
        if a not in built:
            segment_config = dataclasses.replace(base.config, num_microbatches=a)
            built[a] = (base if a == base.config.num_microbatches
                        else build_schedule(config.schedule.pipeline_schedule, segment_config))
        offset = microbatches_before(config, first) - first * a
        for worker, batch_fn in zip(workers, data):
            worker.setup.microbatches_per_update = a
            worker.setup.batch_fn = (lambda fn: lambda mb: fn(mb + offset))(batch_fn)
        built[a] = built[a].segment(first, count)
        return built[a]

    return schedule_for
