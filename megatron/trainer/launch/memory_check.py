"""``--no-memory-check`` and the up-front refusal of a run that cannot fit memory.

Why: without it, a run too large for its machine dies inside a rank with an allocator
traceback (``DefaultCPUAllocator: can't allocate memory``, a CUDA OOM) after the launch,
rendezvous and model build; on a shared host it may push other jobs into the OOM killer first.
Here, in the launching process before any rank starts (the local launcher, the emulator, a
single-rank run) and, under torchrun or Slurm, in each rank before its process group exists,
the estimate of :mod:`megatron.trainer.plan.memory_estimate` is compared with:

* **CPU**: ``MemAvailable`` of ``/proc/meminfo`` (what the kernel can hand out without swapping)
  against the ranks this host runs, summed: every rank for the local launcher, one process
  holding every stage for the emulator, the node's ``LOCAL_WORLD_SIZE`` ranks under torchrun
  (whose baselines are already resident there, so only their model state and activations are
  added);
* **GPU**: ``torch.cuda.mem_get_info`` of the rank's device against that rank's estimate (the
  ranks sharing the device, summed). The local launcher does not create a CUDA context of its
  own to ask (it would hold device memory for the whole run); its fresh GPU ranks check.

Threshold: refused when the estimate exceeds what is available (ratio > 1). The estimate is
within about 25 % of the measured peak (``tests/test_memory_estimate.py``), so a run estimated
a little under the limit can still fail and one a little over may fit: ``--no-memory-check``
runs it anyway. One ``error:`` line names the estimate and what is available.
"""
from __future__ import annotations

import dataclasses
import os

from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.run_plan import MemoryRoom, RunPlan
from megatron.trainer.plan.memory_estimate import GIB, MemoryEstimate, current_rss_bytes, estimate_memory


def host_available_bytes() -> float:
    """``MemAvailable`` in bytes (``inf`` where ``/proc/meminfo`` has none: nothing to compare)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


def local_stages(config: RunPlan, in_worker: bool) -> list[int]:
    """The pipeline stage of each rank this host runs, one entry per rank (the emulator: its one
    process holds every stage). Ranks are numbered TP fastest, then DP, then PP."""
    if config.schedule.pipeline_executor == "emulator":
        return list(range(config.parallel.pipeline_model_parallel_size))
    per_stage = config.parallel.world_size // config.parallel.pipeline_model_parallel_size
    first, count = 0, config.parallel.world_size
    if in_worker:  # torchrun / Slurm: this node's LOCAL_WORLD_SIZE consecutive ranks
        first = int(os.environ["RANK"]) - int(os.environ.get("LOCAL_RANK", 0))
        count = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return [r // per_stage for r in range(first, min(first + count, config.parallel.world_size))]


def _refusal(what: str, need: float, have: float, estimate: MemoryEstimate, where: str) -> ConfigError:
    top = estimate.peak_rank
    return ConfigError(
        f"memory: {what} need about {need / GIB:,.2f} GiB, {where} has {have / GIB:,.2f} GiB available "
        f"(largest rank: stage {top.stage}, {top.total / GIB:,.2f} GiB for {top.parameters:,} parameters "
        f"with gradients, optimizer state and activations); pass --no-memory-check to run anyway")


Room = tuple[float, list[int]]  # (bytes left after the estimate, the stages it counted)


def check_host_memory(config: RunPlan, in_worker: bool, available: float | None = None
                      ) -> tuple[MemoryEstimate, Room]:
    """The CPU check (see the module docstring); returns the estimate it used and the room left."""
    baseline = current_rss_bytes()
    estimate = estimate_memory(config, baseline, "cpu")
    stages = local_stages(config, in_worker)
    need = estimate.ranks_total(stages)
    if config.schedule.pipeline_executor == "emulator":
        need -= baseline * (len(stages) - 1)  # one process, one baseline
    elif in_worker:
        need -= baseline * len(stages)  # the node's ranks are running: their baselines are resident
    have = host_available_bytes() if available is None else available
    if config.launch.memory_check and need > have:
        what = ("the emulator's one process holding every stage" if config.schedule.pipeline_executor == "emulator"
                else f"{len(stages)} rank(s) on this host")
        raise _refusal(what, need, have, estimate, "this host")
    return estimate, (have - need, stages)


def check_gpu_memory(config: RunPlan, in_worker: bool) -> tuple[MemoryEstimate, Room]:
    """The GPU check, in a process that uses the device anyway (it creates the CUDA context):
    this rank's device against the ranks of this host that share it."""
    import torch

    estimate = estimate_memory(config, 0.0, "cuda")
    count = torch.cuda.device_count()
    local = int(os.environ.get("LOCAL_RANK", 0)) if in_worker else 0
    stages = local_stages(config, in_worker)
    if config.schedule.pipeline_executor != "emulator":  # local rank i runs on device i % count
        stages = [s for i, s in enumerate(stages) if i % count == local % count]
    need = estimate.ranks_total(stages)
    free, _total = torch.cuda.mem_get_info(local % count)
    if config.launch.memory_check and need > free:
        raise _refusal(f"{len(stages)} rank(s) on GPU {local % count}", need, free, estimate,
                       f"GPU {local % count}")
    return estimate, (free - need, stages)


def check_memory(config: RunPlan, in_worker: bool, on_gpu: bool) -> RunPlan:
    """Run the check that applies here; the config with the estimate and the room it left
    (``plan.memory``: the banner and ``auto`` read it),
    unchanged where this process does not check (the local launcher of GPU ranks: each rank
    checks its own device). Raises :class:`ConfigError`."""
    if config.task.model_family == "synthetic":
        return config  # a task without transformer layers: nothing to estimate
    if on_gpu and not in_worker and config.parallel.world_size > 1 and config.schedule.pipeline_executor != "emulator":
        return config
    estimate, room = check_gpu_memory(config, in_worker) if on_gpu else check_host_memory(config, in_worker)
    return dataclasses.replace(config, memory=MemoryRoom(estimate, room))
