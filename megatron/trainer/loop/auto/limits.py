"""The host's limits on ``--pipeline-schedule auto``'s choice (:class:`~megatron.pipeline.planner.decide.Limits`),
set before any rank starts: the activation-memory limit from the device's memory, and the cores a
CPU host's pipeline shares.

**Memory.** The activation-memory limit ``--pipeline-schedule auto`` chooses within, from the device's memory.

Why here, before any rank starts: ``auto`` only knows which schedule it runs after profiling,
but the up-front memory check (:mod:`megatron.trainer.launch.memory_check`) needs a schedule. The decision made for
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

**Cores.** ``--pipeline-schedule auto`` on a CPU host whose cores the run's ranks outnumber.

Why: with more local ranks than cores (PP = 4 on a 2-core laptop or CI host) the stages
time-share the cores, and a schedule that fills pipeline bubbles gains nothing once the cores
are busy; ``auto`` then ranks candidates with processor sharing
(:mod:`megatron.pipeline.planner.shared_cores`) instead of a device per stage. The cores one
pipeline gets are the host's over its local ranks, times the pipeline's stages: the same number
on every rank (``os.cpu_count()``, the count the trainer's default ``--num-threads`` divides,
not a rank's own affinity mask, which core binding narrows), so every rank makes the same choice.
"""
from __future__ import annotations

import math
import os

from megatron.pipeline.planner.auto_schedule import auto_options
from megatron.pipeline.schedules import SELECTORS
from megatron.pipeline.schedules.zero_bubble.flags import memory_limit_of
from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.launch.host import runs_on_cpu


def device_memory_limit(estimate: object, room: float, stages: list[int]) -> float:
    """``L`` of the module docstring (may be below 1: not even one micro-batch fits)."""
    per = [estimate.stages[s] for s in stages]  # type: ignore[attr-defined]
    unit = sum(s.per_microbatch for s in per)
    if unit <= 0:
        return math.inf
    return math.floor((room + sum(s.in_flight * s.per_microbatch for s in per)) / unit)


def apply_auto_memory_limit(config: RunPlan) -> RunPlan:
    """Give an ``auto`` run without ``--zb-memory-limit`` the device's limit (after the memory
    check ran; one-line :class:`ConfigError` when no micro-batch fits): the config with it."""
    run = config.run
    room = config.memory.room if config.memory is not None else None
    estimate = config.memory.estimate if config.memory is not None else None
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
    return config.with_schedule_options(memory_limit=float(limit))


def pipeline_cores(cores: int, local_ranks: int, stages: int) -> float | None:
    """The cores one pipeline's ``stages`` share when ``local_ranks`` outnumber ``cores``, else None."""
    if local_ranks <= cores:
        return None
    return cores * stages / local_ranks


def apply_auto_host_cores(config: RunPlan) -> RunPlan:
    """Give an ``auto`` run on a shared CPU host its pipeline's cores (option ``host_cores``):
    the config with them."""
    run = config.run
    if config.schedule.pipeline_schedule not in SELECTORS or run is None or not runs_on_cpu(config) \
            or auto_options(run.schedule.options).host_cores is not None:
        return config
    stages = config.parallel.pipeline_model_parallel_size
    ranks = stages * config.parallel.data_parallel_size * (config.parallel.tensor_model_parallel_size or 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
    cores = pipeline_cores(os.cpu_count() or 1, local, stages)
    if cores is None:
        return config
    return config.with_schedule_options(host_cores=cores)
