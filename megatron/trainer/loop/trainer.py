"""The trainer, top to bottom: ``pretrain`` parses and plans the run, then a :class:`Trainer` trains it.

``pretrain(task, argv)`` checks every flag and makes every launch-time decision first
(:func:`preflight`: the launch's checks, ``auto``'s plan, the schedule's replay), then runs all
stages in this process (``--pipeline-executor emulator``), this rank's stage (under torchrun or
our launcher), or starts one process per rank on this machine, each of which builds its
:class:`Trainer` (:mod:`megatron.trainer.launch.local`).

A :class:`Trainer`'s construction builds what one process trains with: the process group and
the transport (:meth:`Trainer.for_rank`; the emulator's one-process group and in-process
transport in :func:`emulate`, both from :mod:`.ranks`), the local stage workers (resumed from
``--load``), the start banner, the logger, the schedule from the first iteration and the plan of
segments (:func:`~.run_start.start_run`). :meth:`Trainer.train` runs the segments (:mod:`.segments`, :mod:`.runners`), with
``auto``'s one seam between them (:mod:`.auto`: segment ended, optional decision, rebuild), and
then the summary and the dumps. The emulator and every rank of the runtime train the same way.
"""
from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from megatron.pipeline.runtime.executors.errors import PipelineRuntimeError
from megatron.pipeline.runtime.parallel import StageGroups
from megatron.pipeline.runtime.transport import Transport
from megatron.pipeline.runtime.worker import StageWorker
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.launch.entry import enter_process
from megatron.trainer.launch.exit_control import StopControl, Terminated
from megatron.trainer.launch.local import launch_ranks
from megatron.trainer.checkpointing.load import check_resume_or_exit
from megatron.trainer.launch.preflight import check_launch, refused_in_one_line
from megatron.trainer.launch.schedule_check import check_schedule
from megatron.trainer.loop import auto
from megatron.trainer.loop.rampup import segment_schedules
from megatron.trainer.loop.ranks import emulator_process, fail, rank_process
from megatron.trainer.loop.run_start import start_run
from megatron.trainer.loop.runners import PipelineRunner
from megatron.trainer.loop.segments import run_segments
from megatron.trainer.loop.workers import dump_parameters, local_workers, print_drift_histograms
from megatron.trainer.tasks.task import PretrainTask


def pretrain(task: PretrainTask, argv: list[str] | None = None, script: str | None = None) -> int:
    """Entry point of ``pretrain_*.py``: parse and plan, then train; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    code = enter_process()
    if code is not None:
        return code
    plan = preflight(task, argv)  # a rank our launcher started: the launcher's plan, argv unread
    if plan.config.schedule.pipeline_executor == "emulator":
        emulate(task, plan)
        return 0
    return launch_ranks(plan, [script or sys.argv[0], *argv], lambda: run_distributed(task, plan))


def preflight(task: PretrainTask, argv: list[str]) -> RunPlan:
    """Every up-front check and decision of a launch, before any rank starts: the launch's
    checks (:func:`~megatron.trainer.launch.preflight.check_launch`), ``auto``'s plan
    (:func:`megatron.trainer.loop.auto.plan`), then a replay of the schedule's first iterations;
    exits with status 2 and one ``error:`` line on the first problem."""
    plan, flags = check_launch(task, argv)
    with refused_in_one_line():  # a schedule that deadlocks, or auto's choice that cannot run
        plan = auto.plan(task, plan, flags)
        check_schedule(plan)
    return plan


def emulate(task: PretrainTask, plan: RunPlan) -> list[StageWorker]:
    """Train all stages in this process; return the stage workers (weights, statistics)."""
    process = emulator_process(task, plan)
    try:
        return Trainer(task, process.plan, process.transport, process.device, process.stop,
                       process.make_transport).train()
    finally:
        if process.stop is not None:
            process.stop.restore()


def run_distributed(task: PretrainTask, plan: RunPlan) -> int:
    """This rank's stage: its :class:`Trainer`; exit code 0 (a failure ends the process at
    once, naming the stage)."""
    Trainer.for_rank(task, plan).train()
    return 0


@contextlib.contextmanager
def _failures_end_the_rank(where: str) -> Iterator[None]:
    """Any failure inside ends this rank at once with one line naming ``where`` (its stage and
    rank): a rank that lingers would hang the others."""
    try:
        yield
    except PipelineRuntimeError as exc:
        fail(f"[megatron-async] error: {exc}")
    except Terminated as exc:  # outside the pipeline: between segments, saving, evaluating
        fail(f"[megatron-async] error: {where}: {exc}")
    except Exception as exc:  # noqa: BLE001 - any failure must end this rank, not hang it
        traceback.print_exc()
        fail(f"[megatron-async] error: {where}: {type(exc).__name__}: {exc}")


class Trainer:
    """One process's training: its local stages, their schedule and logger (module docstring).

    Built on a transport (``make_transport``: a transport for another layout of the same
    processes, where ``auto`` may rebuild the stages; ``groups``: a rank's process groups);
    :meth:`for_rank` builds the rank's process group and transport first, :func:`emulate` the
    emulator's."""

    def __init__(self, task: PretrainTask, plan: RunPlan, transport: Transport, device: torch.device,
                 stop: StopControl | None = None, make_transport: Callable[[RunPlan], Transport] | None = None,
                 groups: StageGroups | None = None, where: str = ""):
        self.task, self.plan, self.transport, self.stop = task, plan, transport, stop
        self.groups, self.where = groups, where
        self.rebuilds = auto.Rebuilds(task, device, make_transport) if make_transport else None
        resume = check_resume_or_exit(task, plan, verify_files=False)  # each process verifies the files it loads
        self.workers = local_workers(task, plan, transport, device)
        self.run = start_run(task, plan, transport, self.workers, resume,
                             boundary=self.rebuilds.boundary if self.rebuilds else None)
        self.schedule = self.run.schedule

    @classmethod
    def for_rank(cls, task: PretrainTask, plan: RunPlan) -> Trainer:
        """This rank's trainer (:func:`~.ranks.rank_process`: host, process group, transport);
        a failure building its stages ends the process at once, naming the stage."""
        p = rank_process(task, plan)
        with _failures_end_the_rank(p.where):
            return cls(task, p.plan, p.transport, p.device, p.stop, p.make_transport, p.groups, p.where)
        raise AssertionError("unreachable: a failure ended the rank")  # for the type checker

    def train(self) -> list[StageWorker]:
        """Run the segments, then the summary and the dumps; the local stage workers (weights,
        statistics). A rank ends its process group after; a failure ends the rank at once."""
        if self.groups is None:
            return self._train()
        with _failures_end_the_rank(self.where):
            self._train()
        dist.barrier(group=self.groups.reports)
        dist.destroy_process_group()
        return self.workers

    def _runner(self) -> PipelineRunner:
        """The segment runner of the current stages (again after a rebuild)."""
        run = self.run
        return PipelineRunner.for_run(self.task, self.plan, self.transport, self.workers, run.cadence, run.logged,
                                      run.gc_policy, self.stop)

    def _train(self) -> list[StageWorker]:
        run = self.run
        segments, boundary = run.segments, run.boundary
        with run.gc_policy.training():
            runner = self._runner()
            while segments:
                now = [s for s in segments if boundary is None or s.end <= boundary]
                last = run_segments(self.schedule, now, runner, run.logger, say=run.say, stop=self.stop,
                                    schedule_for=segment_schedules(self.plan, self.schedule, self.workers))
                segments, boundary = segments[len(now):], None
                if last is None:
                    break
                self.schedule = last
                if self.rebuilds is None or not segments:
                    continue
                stages = auto.Stages(self.plan, self.transport, self.workers, self.schedule)
                rebuilt = self.rebuilds.after_segment(stages, runner, now[-1].end, run.say)
                if rebuilt is not None:  # auto decided to rebuild the stages in another layout
                    self.plan, self.transport, self.workers, self.schedule = \
                        rebuilt.plan, rebuilt.transport, rebuilt.workers, rebuilt.schedule
                    runner = self._runner()
        self._finish()
        return self.workers

    def _finish(self) -> None:
        """The run's summary and what ``--log-weight-version-drift`` / ``--dump-final-params`` ask for."""
        transport, plan = self.transport, self.plan
        transport.flush()
        if self.run.logger:
            self.run.logger.log_summary()
            self.run.logger.close()
        if plan.logging.log_weight_version_drift and transport.dp_rank == 0 and transport.tp_rank == 0:
            print_drift_histograms(self.workers)
        if plan.logging.dump_final_params and transport.dp_rank == 0:
            for w in self.workers:
                dump_parameters(self.task, w, plan.logging.dump_final_params, transport.tp_rank)
