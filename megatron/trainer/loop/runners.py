"""How the emulator and the distributed runtime train a segment, evaluate and checkpoint.

Both implement :class:`megatron.trainer.loop.segments.SegmentRunner` over the same stage workers and
schedules; they differ only in where stages live (all here, or one per process) and so in
how evaluation results are summed and how checkpoint writers are coordinated.
"""
from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.pipeline.runtime.executors.common import ReportCadence, ReportSink
from megatron.pipeline.runtime.executors.distributed import DistributedExecutor
from megatron.pipeline.runtime.executors.emulator import Emulator
from megatron.pipeline.runtime.parallel import StageGroups
from megatron.pipeline.runtime.profiling import distributed_profiling, emulator_profiling
from megatron.pipeline.schedules.base import Schedule
from megatron.pipeline.schedules.evaluation import evaluation_ops, evaluation_streams
from megatron.pipeline.runtime.tracing import StageTracer
from megatron.pipeline.runtime.worker import StageWorker
from megatron.trainer.checkpointing import checkpoint as ckpt
from megatron.trainer.tasks.task import Batch, PretrainTask


def _tracer(args: argparse.Namespace, worker: StageWorker, dp_rank: int, executor: str) -> StageTracer | None:
    """This stage's tracer with ``--trace-dir`` (kept across segments), else None."""
    if getattr(args, "trace_dir", None) is None:
        return None
    return StageTracer(worker.stage, dp_rank, worker.layout, executor, args.pipeline_schedule,
                       worker.setup.microbatches_per_update, worker.setup.device)


@contextlib.contextmanager
def _tracing(workers: list[StageWorker], tracers: list[StageTracer | None], args: argparse.Namespace) -> Iterator[None]:
    """Trace training segments only (evaluation is not part of the schedule's timeline); write the
    cumulative trace files at the end of each segment, so a run that stops early still leaves them."""
    if not tracers or tracers[0] is None:
        yield
        return
    for w, t in zip(workers, tracers):
        w.tracer = t
    try:
        yield
    finally:
        for w, t in zip(workers, tracers):
            w.tracer = None
            assert t is not None
            t.write(args.trace_dir)


class EvaluationData:
    """Batch functions of the validation and test splits, built once (None: no data)."""

    def __init__(self, task: PretrainTask, args: argparse.Namespace, dp_rank: int, device: torch.device):
        self._build = lambda split: task.batch_fn(args, dp_rank, device, split=split)
        self._fns: dict[str, Callable[[int], Batch] | None] = {}
        self.num_microbatches = args.eval_iters * args.num_microbatches  # per data-parallel replica

    def batch_fn(self, split: str) -> Callable[[int], Batch] | None:
        if split not in self._fns:
            try:
                self._fns[split] = self._build(split)
            except ValueError:  # the split has no data (validation was checked up front)
                self._fns[split] = None
        return self._fns[split]


class EmulatorRunner:
    """All stages in this process."""

    def __init__(self, task: PretrainTask, args: argparse.Namespace, workers: list[StageWorker],
                 cadence: ReportCadence, sink: ReportSink):
        self.task, self.args, self.workers = task, args, workers
        self.cadence, self.sink = cadence, sink
        self.data = EvaluationData(task, args, 0, workers[0].setup.device)
        self.tracers = [_tracer(args, w, 0, "emulator") for w in workers]

    def train(self, schedule: Schedule) -> None:
        self.schedule = schedule  # what it decides while training (zb's profiled order) is checkpointed
        hook = emulator_profiling(schedule, self.workers)  # zb-1p / zb-2p with --zb-profile-iters
        with _tracing(self.workers, self.tracers, self.args):
            Emulator(self.workers, schedule.layout, self.cadence, self.sink, sync_hook=hook,
                     outcomes=getattr(schedule, "validation_outcomes", None)).run(schedule.streams())

    def evaluate(self, split: str) -> tuple[float, int] | None:
        batch_fn = self.data.batch_fn(split)
        if batch_fn is None:
            return None
        for w in self.workers:
            w.begin_evaluation(batch_fn)
        layout = self.workers[0].layout
        Emulator(self.workers, layout, self.cadence, self.sink).run(
            evaluation_streams(layout, self.data.num_microbatches))
        results = [w.end_evaluation() for w in self.workers]
        return sum(loss for loss, _ in results), sum(tokens for _, tokens in results)

    def save(self, iteration: int) -> None:
        root = self.args.save
        ckpt.prepare_staging(root, iteration)
        for w in self.workers:
            ckpt.write_rank_file(root, iteration, w.stage, 0, ckpt.stage_state(self.task, w))
        ckpt.publish(root, iteration, ckpt.run_signature(self.task, self.args), len(self.workers), 1,
                     ckpt.schedule_state(getattr(self, "schedule", None)))


class DistributedRunner:
    """This rank's stage; the others run the same calls in their processes."""

    def __init__(self, task: PretrainTask, args: argparse.Namespace, worker: StageWorker, groups: StageGroups,
                 cadence: ReportCadence, sink: ReportSink, timeout: timedelta):
        self.task, self.args, self.worker, self.groups = task, args, worker, groups
        self.cadence, self.sink, self.timeout = cadence, sink, timeout
        self.data = EvaluationData(task, args, groups.dp_rank, worker.setup.device)
        self.tracer = _tracer(args, worker, groups.dp_rank, "distributed")

    def train(self, schedule: Schedule) -> None:
        self.schedule = schedule  # what it decides while training (zb's profiled order) is checkpointed
        hook = distributed_profiling(schedule, self.worker, self.groups, self.timeout, log=self.groups.rank == 0)
        if self.tracer is not None:  # a common instant for aligning the ranks' clocks
            dist.barrier(group=self.groups.reports)
            self.tracer.mark_aligned()
        with _tracing([self.worker], [self.tracer], self.args):
            DistributedExecutor(self.worker, self.groups, self.cadence, self.sink, self.timeout, sync_hook=hook,
                                outcomes=getattr(schedule, "validation_outcomes", None)).run(
                schedule.stage_ops(self.groups.stage))

    def evaluate(self, split: str) -> tuple[float, int] | None:
        batch_fn = self.data.batch_fn(split)
        if batch_fn is None:  # every rank sees the same data, so all skip together
            return None
        self.worker.begin_evaluation(batch_fn)
        DistributedExecutor(self.worker, self.groups, self.cadence, self.sink, self.timeout).run(
            evaluation_ops(self.groups.stage, self.worker.layout, self.data.num_microbatches))
        loss_sum, tokens = self.worker.end_evaluation()
        # Only last-stage ranks hold losses; every replica evaluated its own share.
        total = torch.tensor([loss_sum, float(tokens)], dtype=torch.float64)
        dist.all_reduce(total, group=self.groups.reports)
        return float(total[0]), int(total[1])

    def save(self, iteration: int) -> None:
        root, coordinator = self.args.save, self.groups.rank == 0
        if coordinator:
            ckpt.prepare_staging(root, iteration)
        dist.barrier(group=self.groups.reports)
        ckpt.write_rank_file(root, iteration, self.groups.stage, self.groups.dp_rank,
                             ckpt.stage_state(self.task, self.worker))
        dist.barrier(group=self.groups.reports)
        if coordinator:
            layout = self.groups.layout
            ckpt.publish(root, iteration, ckpt.run_signature(self.task, self.args),
                         layout.pipeline_size, layout.data_parallel_size,
                         ckpt.schedule_state(getattr(self, "schedule", None)))
        dist.barrier(group=self.groups.reports)
