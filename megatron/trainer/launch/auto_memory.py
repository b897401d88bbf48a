"""The activation-memory limit ``--pipeline-schedule auto`` chooses within, from the device's memory.

Why here, before any rank starts: ``auto`` only knows which schedule it runs after profiling,
but the up-front memory check (:mod:`.memory_check`) needs a schedule. The decision made for
it: the check validates what runs first (the ZB-H1 profiling iterations, whose in-flight
micro-batches per stage are 1F1B's ``N - s`` within the estimate's accuracy), and the memory
left over becomes the limit the choice must respect. Converting it into the profiler's unit
(one micro-batch's activations on a stage, ``M_B``): every local rank may hold ``L`` micro-batches
in flight instead of its current peak ``k_s``, which costs ``(L - k_s) * a_s`` more bytes
(``a_s``: :attr:`~megatron.pipeline.costs.memory.RankMemory.per_microbatch`), so the largest ``L`` with
``sum_s (L - k_s) a_s <= room`` is ``L = (room + sum_s k_s a_s) / sum_s a_s``, floored to whole
micro-batches. ``--zb-memory-limit`` replaces it; ``--no-memory-check`` drops it (no limit).

Where ranks check for themselves (GPU ranks under torchrun or the local launcher) each derives
its own ``L`` from its own free memory; ranks that disagree choose differently, which the
profiling hook's every-rank fingerprint check reports as an error: pass ``--zb-memory-limit``.
"""
from __future__ import annotations

import math

from megatron.pipeline.schedules.zero_bubble.flags import memory_limit_of
from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.job_config import JobConfig, with_schedule_options


def device_memory_limit(estimate: object, room: float, stages: list[int]) -> float:
    """``L`` of the module docstring (may be below 1: not even one micro-batch fits)."""
    per = [estimate.stages[s] for s in stages]  # type: ignore[attr-defined]
    unit = sum(s.per_microbatch for s in per)
    if unit <= 0:
        return math.inf
    return math.floor((room + sum(s.in_flight * s.per_microbatch for s in per)) / unit)


def apply_auto_memory_limit(config: JobConfig) -> JobConfig:
    """Give an ``auto`` run without ``--zb-memory-limit`` the device's limit (after the memory
    check ran; one-line :class:`ConfigError` when no micro-batch fits): the config with it."""
    from megatron.pipeline.schedules import SELECTORS

    run = config.run
    room = config.launch.memory_room
    estimate = config.launch.memory_estimate
    if config.schedule.pipeline_schedule not in SELECTORS or run is None or room is None or estimate is None \
            or not config.launch.memory_check or memory_limit_of(run.schedule.options) is not None:
        return config
    limit = device_memory_limit(estimate, *room)
    if math.isinf(limit):
        return config
    if limit < 1:
        raise ConfigError(f"--pipeline-schedule {config.schedule.pipeline_schedule}: the device memory left after "
                          f"weights and optimizer state holds {limit:g} micro-batches of activations; "
                          "at least 1 is needed")
    return with_schedule_options(config, memory_limit=float(limit))
