"""How a run trains a segment, evaluates and checkpoints, in the emulator and the runtime alike.

:class:`PipelineRunner` implements :class:`megatron.trainer.loop.segments.SegmentRunner` over the
local stage workers and a :class:`~megatron.pipeline.runtime.transport.Transport`, which says
where the stages live (all here, or one per process) and so sums evaluation results and
coordinates checkpoint writers.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from megatron.pipeline.runtime.executors.common import ReportCadence, ReportSink
from megatron.pipeline.runtime.executors.run import run_streams
from megatron.pipeline.runtime.profiling import schedule_profiling
from megatron.pipeline.runtime.report import StageReport
from megatron.pipeline.runtime.transport import Transport
from megatron.pipeline.schedules.base import Schedule
from megatron.pipeline.schedules.evaluation import evaluation_ops
from megatron.pipeline.schedules.zero_bubble.post_validation import ValidationOutcomes
from megatron.pipeline.runtime.tracing import StageTracer
from megatron.pipeline.runtime.worker import StageWorker
from megatron.trainer.checkpointing import checkpoint as ckpt
from megatron.trainer.checkpointing.fault_injection import kill_here_if_asked
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.launch.exit_control import StopControl
from megatron.trainer.launch.python_gc import CollectorPolicy
from megatron.trainer.loop.logger import ReportCollector
from megatron.trainer.tasks.task import Batch, PretrainTask


def _validation_outcomes(schedule: Schedule) -> ValidationOutcomes | None:
    """Post-validation's outcomes the executors record into (None: the streams validate nothing)."""
    validation = schedule.policy.post_validation
    return None if validation is None else validation.outcomes


def _tracer(config: RunPlan, worker: StageWorker, dp_rank: int, executor: str) -> StageTracer | None:
    """This stage's tracer with ``--trace-dir`` (kept across segments), else None."""
    if config.logging.trace_dir is None:
        return None
    return StageTracer(worker.stage, dp_rank, worker.layout, executor, config.schedule.pipeline_schedule,
                       worker.setup.microbatches_per_update, worker.setup.device)


@contextlib.contextmanager
def _tracing(workers: list[StageWorker], tracers: list[StageTracer | None], config: RunPlan,
             writes: bool) -> Iterator[None]:
    """Trace training segments only (evaluation is not part of the schedule's timeline); write the
    cumulative trace files at the end of each segment, so a run that stops early still leaves them.
    ``writes`` is False on tensor-parallel ranks other than 0: they trace (the clock alignment is a
    collective) but their op streams are their TP rank 0's, whose file is the stage's."""
    if not tracers or tracers[0] is None:
        yield
        return
    for w, t in zip(workers, tracers):
        assert t is not None
        w.hooks.start_tracing(t)
    try:
        yield
    finally:
        for w, t in zip(workers, tracers):
            w.hooks.stop_tracing()
            assert t is not None
            if writes:
                t.write(config.logging.trace_dir)


class EvaluationData:
    """Batch functions of the validation and test splits, built once (None: no data)."""

    def __init__(self, task: PretrainTask, config: RunPlan, dp_rank: int, device: torch.device):
        self._build = lambda split: task.batch_fn(config, dp_rank, device, split=split)
        self._fns: dict[str, Callable[[int], Batch] | None] = {}
        self.num_microbatches = config.training.eval_iters * config.num_microbatches  # per data-parallel replica

    def batch_fn(self, split: str) -> Callable[[int], Batch] | None:
        if split not in self._fns:
            try:
                self._fns[split] = self._build(split)
            except ValueError:  # the split has no data (the flag checks looked up front)
                self._fns[split] = None
        return self._fns[split]


class PipelineRunner:
    """The local stages (all of them in the emulator, this rank's in the runtime); the other
    processes, if any, run the same calls."""

    def __init__(self, task: PretrainTask, config: RunPlan, transport: Transport,
                 workers: list[StageWorker], cadence: ReportCadence, sink: ReportSink,
                 collector: CollectorPolicy | None = None):
        self.task, self.config, self.transport, self.workers = task, config, transport, workers
        self.cadence, self.sink = cadence, sink
        self.collector = collector or CollectorPolicy()
        self.data = EvaluationData(task, config, transport.dp_rank, workers[0].setup.device)
        self.tracers = [_tracer(config, w, transport.dp_rank, transport.name) for w in workers]
        self.schedule: Schedule | None = None  # the last one trained (None: nothing trained yet)

    @classmethod
    def for_run(cls, task: PretrainTask, config: RunPlan, transport: Transport, workers: list[StageWorker],
                cadence: ReportCadence, logged: Callable[[int, list[StageReport]], None] | None,
                collector: CollectorPolicy, stop: StopControl | None) -> PipelineRunner:
        """The runner of a run's current stages (again after ``auto`` rebuilt them): reports go to
        ``logged`` on the logging process, and ``stop``'s agreement over ``transport``."""
        if stop is not None:
            stop.agree = transport.all_max
        reports = ReportCollector(transport.num_reporters, logged) if logged else None
        return cls(task, config, transport, workers, cadence, transport.report_sink(reports), collector)

    def train(self, schedule: Schedule) -> None:
        self.schedule = schedule  # what it decides while training (zb's profiled order) is checkpointed
        hook = schedule_profiling(schedule, self.transport, self.workers)  # zb-1p / zb-2p with --zb-profile-iters
        if self.tracers and self.tracers[0] is not None:
            self.transport.align_clocks([t for t in self.tracers if t is not None])
        with _tracing(self.workers, self.tracers, self.config, writes=self.transport.tp_rank == 0):
            run_streams(self.transport, self.workers, self.transport.local_streams(schedule), self.cadence,
                        self.sink, sync_hook=hook, outcomes=_validation_outcomes(schedule),
                        after_update=self.collector.after_update)
        for w in self.workers:  # a segment ends with whole weights (--overlap-param-gather)
            w.params_ready()

    def evaluate(self, split: str) -> tuple[float, int] | None:
        batch_fn = self.data.batch_fn(split)
        if batch_fn is None:  # every rank sees the same data, so all skip together
            return None
        self.collector.evaluation_boundary()
        for w in self.workers:
            w.begin_evaluation(batch_fn)
        layout = self.workers[0].layout
        streams = [evaluation_ops(s, layout, self.data.num_microbatches) for s in self.transport.stages]
        run_streams(self.transport, self.workers, streams, self.cadence, self.sink)
        results = [w.end_evaluation() for w in self.workers]
        self.collector.evaluation_boundary()
        # Only last stages hold losses; every data-parallel replica evaluated its own share,
        # and the tensor-parallel ranks of a stage the same one (TP rank 0 counts it).
        if self.transport.tp_rank:
            results = [(0.0, 0) for _ in results]
        loss_sum, tokens = self.transport.all_sum([sum(loss for loss, _ in results),
                                                   float(sum(tokens for _, tokens in results))])
        return loss_sum, int(tokens)

    def save(self, iteration: int, root: str | None = None) -> None:
        """A checkpoint of iteration ``iteration`` under ``root`` (default ``--save``)."""
        root, transport = root or self.config.checkpoint.save, self.transport
        if transport.is_coordinator:
            ckpt.prepare_staging(root, iteration)
        transport.barrier()
        for w, state in zip(self.workers, ckpt.stage_states(self.task, transport, self.workers)):
            ckpt.write_rank_file(root, iteration, w.stage, transport.dp_rank, state)
        kill_here_if_asked("written", iteration)  # tests only (fault_injection)
        transport.barrier()
        if transport.is_coordinator:
            ckpt.publish(root, iteration, ckpt.run_signature(self.task, self.config),
                         transport.pipeline_size, transport.data_parallel_size,
                         self.config.schedule_state(self.schedule))
        transport.barrier()
