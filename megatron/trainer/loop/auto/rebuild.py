"""``--pipeline-schedule auto`` rebuilding the run's stages in the layout it chose.

Why through a checkpoint: a V or interleaved layout places other layers on each rank, and the
checkpoint format already moves every parameter and its optimizer state by global name into
any layout (:mod:`megatron.trainer.checkpointing.reshard`). So at the decision boundary
(``K = --zb-profile-iters``, a drained segment end) every rank saves, the stages are built
again in the chosen layout (transport included), and each loads what it now holds. The run
then equals one saved at ``K`` and resumed with the chosen schedule (``tests/test_auto_relayout.py``).
The decision is :func:`~.candidates.chosen_relayout` of the segment's last schedule.

Where the checkpoint goes: under ``--save`` (``auto-relayout/``, shared by every node), else a
temporary directory rank 0 makes and names to the others (one node: the launch offers a
rebuild without ``--save`` only there); removed once every rank has loaded.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.pipeline.planner.auto_schedule import AutoSchedule, auto_options
from megatron.pipeline.schedules.base import Schedule
from megatron.trainer.config.run_plan import RunPlan
from megatron.pipeline.runtime.transport import Transport
from megatron.pipeline.runtime.worker import StageWorker
from megatron.trainer.checkpointing.load import check_resume_or_exit
from megatron.trainer.loop.auto.candidates import chosen_config
from megatron.trainer.loop.run_start import resume_workers, run_schedule
from megatron.trainer.loop.runners import PipelineRunner
from megatron.trainer.loop.workers import local_workers
from megatron.trainer.tasks.task import PretrainTask

#: the checkpoint directory of a rebuild under ``--save``
RELAYOUT_DIR = "auto-relayout"


def relayout_boundary(schedule: Schedule, start: int, end: int) -> int | None:
    """The iteration an ``auto`` run may rebuild at (a segment must end there): where its
    profiling ends, when it profiles with layouts to rebuild in; None otherwise."""
    if not isinstance(schedule, AutoSchedule) or schedule.decided or not auto_options(schedule.config.options).relayouts:
        return None
    k = schedule.profile_end
    return k if start < k < end else None


@dataclass
class RebuildDir:
    """Where a rebuild's checkpoint is written and read (module docstring)."""

    root: Path
    temporary: bool

    @classmethod
    def agree(cls, config: RunPlan) -> "RebuildDir":
        """The same directory on every rank (collective where there are several)."""
        if config.checkpoint.save is not None:
            return cls(Path(config.checkpoint.save) / RELAYOUT_DIR, False)
        name = [tempfile.mkdtemp(prefix="megatron-async-relayout-") if dist.get_rank() == 0 else ""]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(name, src=0)
        return cls(Path(name[0]), True)

    def remove(self) -> None:
        """Rank 0, after every rank loaded."""
        if dist.get_rank() == 0:
            shutil.rmtree(self.root, ignore_errors=True)


def rebuild(task: PretrainTask, config: RunPlan, transport: Transport, runner: PipelineRunner, decision: dict,
            iteration: int, device: torch.device,
            make_transport: Callable[[RunPlan], Transport]) -> tuple[RunPlan, Transport, list[StageWorker], Schedule]:
    """Save at ``iteration`` (drained), build the chosen layout's stages and transport, load:
    (its config, transport, local workers, schedule from ``iteration``); collective."""
    where = RebuildDir.agree(config)
    runner.save(iteration, root=str(where.root))
    transport.flush()
    runner.workers.clear()  # the old stages' memory goes before the new ones are built
    config = rebuilt_config(config, decision, where)
    transport = make_transport(config)
    resume = check_resume_or_exit(task, config, verify_files=False)
    workers = local_workers(task, config, transport, device)
    resume_workers(task, config, workers, transport.dp_rank, resume, say=False)
    transport.barrier()  # every rank has read its files
    where.remove()
    return config, transport, workers, run_schedule(config, iteration, resume)


def rebuilt_config(config: RunPlan, decision: dict, where: RebuildDir) -> RunPlan:
    """The chosen layout's job config, loading the rebuild's checkpoint (whole state: optimizer,
    RNG, iteration)."""
    chosen = chosen_config(config, decision)
    return chosen.replace_in("checkpoint", load=str(where.root), no_load_optim=False, finetune=False)


def rebuild_line(decision: dict, iteration: int, began: float) -> str:
    return (f"[megatron-async] auto: rebuilt the stages as {decision['relayout']} at iteration {iteration} "
            f"(checkpoint round trip {time.perf_counter() - began:.1f} s)")
