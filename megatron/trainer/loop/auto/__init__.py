"""``--pipeline-schedule auto`` in the trainer: the one adapter between the planner's decision
(:func:`megatron.pipeline.planner.decide.decide`, pure) and a run.

Why one seam: what ``auto`` needs from the trainer (the host's limits, the configs of the layouts
it may rebuild in, a rebuild at a drained boundary) used to be spread over the launch's checks,
the loop and the driver; here it is one package, and the rest of the trainer sees two things:

* before any rank starts, :func:`plan`: the config with ``auto``'s limits (:mod:`.limits`) and
  candidates (:mod:`.candidates`), started in the layout a checkpoint's run (or fixed costs)
  already chose;
* in the loop, :class:`Rebuilds`: where the first segment must end (the decision boundary),
  and after a segment, an optional decision and the rebuild (:mod:`.rebuild`).

Neither does anything for a run of another schedule.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron.pipeline.runtime.transport import Transport
from megatron.pipeline.runtime.worker import StageWorker
from megatron.pipeline.schedules.base import Schedule
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.loop.auto.candidates import apply_auto_relayouts, chosen_relayout, start_in_chosen_layout
from megatron.trainer.loop.auto.limits import apply_auto_host_cores, apply_auto_memory_limit
from megatron.trainer.loop.auto.rebuild import rebuild, rebuild_line, relayout_boundary
from megatron.trainer.loop.runners import PipelineRunner
from megatron.trainer.tasks.task import PretrainTask


def plan(task: PretrainTask, config: RunPlan, flags: argparse.Namespace | None) -> RunPlan:
    """The config an ``auto`` run starts with (unchanged for another schedule): the memory
    limit left after the memory check, the cores a shared CPU host gives its pipeline, and,
    given the user's ``flags`` (None in a rank our launcher started: its config has them
    already), the layouts it may rebuild in, started in the one already chosen. One-line
    :class:`~megatron.trainer.config.errors.ConfigError` on a choice that cannot run."""
    config = apply_auto_memory_limit(config)  # the memory left after the check bounds the choice
    config = apply_auto_host_cores(config)  # a CPU host with more ranks than cores: shared cores
    if flags is not None:
        config = start_in_chosen_layout(task, apply_auto_relayouts(task, config, flags))
    return config


@dataclass
class Stages:
    """What a rebuild replaces: the run's plan, transport, local workers and schedule."""

    plan: RunPlan
    transport: Transport
    workers: list[StageWorker]
    schedule: Schedule


@dataclass
class Rebuilds:
    """The loop's view of ``auto`` (module docstring); ``make_transport`` builds a transport for
    another layout of the same processes."""

    task: PretrainTask
    device: torch.device
    make_transport: Callable[[RunPlan], Transport]

    @staticmethod
    def boundary(schedule: Schedule, start: int, end: int) -> int | None:
        """The iteration a segment must end at so that ``auto`` may rebuild there; None: none."""
        return relayout_boundary(schedule, start, end)

    def after_segment(self, stages: Stages, runner: PipelineRunner, iteration: int,
                      say: Callable[[str], None]) -> Stages | None:
        """After a segment ending at ``iteration`` ran ``stages.schedule``: the rebuilt stages
        where ``auto`` decided to rebuild (saved, built again, loaded; collective), else None."""
        decision = chosen_relayout(stages.schedule)
        if decision is None:
            return None
        began = time.perf_counter()
        rebuilt = Stages(*rebuild(self.task, stages.plan, stages.transport, runner, decision, iteration,
                                  self.device, self.make_transport))
        say(rebuild_line(decision, iteration, began))
        return rebuilt


__all__ = ["Rebuilds", "Stages", "plan"]
