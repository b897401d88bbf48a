"""The distributed runtime: one process per stage, op streams over torch.distributed P2P.

Receives are posted a few ops ahead (in op order, so per-peer FIFO matching is preserved)
to overlap communication with compute; sends are non-blocking, and each sent tensor is
released as soon as its send completes (:mod:`~megatron.pipeline.runtime.executors.send_reaper`);
activations are freed by the worker as soon as their backward ran. Every wait has a
timeout, and any failure is raised as :class:`PipelineRuntimeError` naming stage and op.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.pipeline.comm import Message, op_recvs
from megatron.pipeline.runtime.executors.common import ReportCadence, ReportSink, run_compute_op
from megatron.pipeline.runtime.executors.errors import PipelineRuntimeError
from megatron.pipeline.runtime.executors.send_reaper import SendReaper, wait_or_raise
from megatron.pipeline.ir import POST_VALIDATION_KINDS, Op, OpKind
from megatron.pipeline.runtime.parallel import StageGroups
from megatron.pipeline.post_validation import ValidationOutcomes
from megatron.pipeline.runtime.post_validation_ops import run_post_validation_op
from megatron.pipeline.runtime.replicas import gather_shards_distributed, has_replicas, reduce_distributed
from megatron.pipeline.runtime.report import StageReport
from megatron.pipeline.runtime.worker import StageWorker


class P2PChannel:
    """Point-to-point messages of one stage, with receives posted ahead of use."""

    def __init__(self, worker: StageWorker, groups: StageGroups, timeout: timedelta):
        self.worker = worker
        self.groups = groups
        self.timeout = timeout
        # Posted receives per message, oldest first: a post-validation replay receives the
        # same activation twice (a stale copy to DRAIN, then the re-sent one).
        self._posted: dict[Message, deque[tuple[dist.Work | None, torch.Tensor]]] = {}
        self._local: dict[Message, torch.Tensor] = {}  # stage sending to itself
        self._sends = SendReaper(timeout, threaded=worker.setup.device.type == "cpu")

    def _peer(self, stage: int) -> int:
        return self.groups.layout.rank(stage, self.groups.dp_rank)

    def post(self, msg: Message) -> None:
        if msg.src_stage == msg.dst_stage:
            return
        shape, dtype = self.worker.recv_spec(msg)
        buf = torch.empty(shape, dtype=dtype, device=self.worker.setup.device)
        group = self.groups.p2p_group(msg.src_stage, msg.dst_stage)
        self._posted.setdefault(msg, deque()).append((dist.irecv(buf, src=self._peer(msg.src_stage), group=group), buf))

    def wait(self, msg: Message) -> torch.Tensor:
        if msg in self._local:
            return self._local.pop(msg)
        if not self._posted.get(msg):
            self.post(msg)
        queue = self._posted[msg]
        work, buf = queue.popleft()
        if not queue:
            del self._posted[msg]
        wait_or_raise(work, self.timeout, f"receiving {msg} from stage {msg.src_stage} (rank {self._peer(msg.src_stage)})")
        return buf

    def send(self, msg: Message, tensor: torch.Tensor) -> None:
        if msg.src_stage == msg.dst_stage:
            self._local[msg] = tensor.clone()
            return
        tensor = tensor.contiguous()  # a no-op (no copy) for the contiguous tensors stages produce
        peer = self._peer(msg.dst_stage)
        group = self.groups.p2p_group(msg.src_stage, msg.dst_stage)
        self._sends.add(peer, dist.isend(tensor, dst=peer, group=group), tensor, msg)

    def flush(self) -> None:
        self._sends.flush()


def _is_barrier(op: Op) -> bool:
    """Ops the prefetch window must not look past: what a stream yields after a pipeline-wide
    step may depend on that step's outcome (profiled costs, post-validation), so later ops
    are pulled from the generator only once the barrier has run."""
    return (op.kind is OpKind.OPT and op.sync) or op.kind is OpKind.VALIDATE


class DistributedExecutor:
    """Runs this rank's stage stream; the other stages run in their own processes."""

    def __init__(
        self,
        worker: StageWorker,
        groups: StageGroups,
        cadence: ReportCadence,
        sink: ReportSink,
        timeout: timedelta,
        prefetch_ops: int = 4,
        sync_hook: Callable[[Op], None] | None = None,
        outcomes: ValidationOutcomes | None = None,
    ):
        self.worker = worker
        # Called after every synchronous step, before later ops are pulled from the stream
        # (profiled Zero Bubble schedules decide their order there).
        self.sync_hook = sync_hook
        self.outcomes = outcomes  # post-validated streams read what VALIDATE records here
        self.groups = groups
        self.cadence = cadence
        self.sink = sink
        self.timeout = timeout
        self.prefetch_ops = prefetch_ops
        self.channel = P2PChannel(worker, groups, timeout)

    # -- optimizer step ---------------------------------------------------------------
    def _all_reduce_data_parallel_grads(self) -> None:
        dp = self.groups.layout.data_parallel_size
        if dp == 1:
            return
        params = self.worker.setup.optimizer.parameters()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=self.groups.data_parallel)
        flat /= dp
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n

    def _optimizer_step(self, op: Op) -> None:
        self._all_reduce_data_parallel_grads()
        self.worker.apply_update(op, self._step_norms(op))
        if op.sync and has_replicas(self.worker.layout):  # sharded optimizer state: all-gather the ranges
            gather_shards_distributed(self.worker, self.groups.replicas)
        if self.cadence.due(op.update):
            self.sink.submit(self.worker.take_report(op.update), replica=self.groups.dp_rank)

    def _step_norms(self, op: Op) -> list[float]:
        """The squared grad norms the step of ``op`` is clipped with (the emulator's, in its order)."""
        layout = self.worker.layout
        if op.sync and has_replicas(layout):  # AMDP: sum over the stage's replicas first
            return reduce_distributed(self.worker, op, self.groups.replicas, self.groups.sync, self.groups.sync_size)
        own = self.worker.grad_sq_norm(op)
        if op.sync and len(layout.sync_group(self.groups.stage)) > 1:  # one chain: all stages
            mine = torch.tensor([own], dtype=torch.float64, device=self.worker.setup.device)
            gathered = [torch.empty_like(mine) for _ in range(self.groups.layout.pipeline_size)]
            dist.all_gather(gathered, mine, group=self.groups.pipeline)
            return [float(t) for t in gathered]  # stage order, like the emulator
        return [own]

    # -- main loop -----------------------------------------------------------------
    def run(self, stream: Iterable[Op]) -> None:
        ops: Iterator[Op] = iter(stream)
        window: deque[Op] = deque()
        layout = self.worker.layout
        current: Op | None = None
        try:
            while True:
                while len(window) < self.prefetch_ops and not (window and _is_barrier(window[-1])):
                    op = next(ops, None)
                    if op is None:
                        break
                    window.append(op)
                    for msg in op_recvs(op, layout):
                        self.channel.post(msg)
                if not window:
                    break
                current = window.popleft()
                if current.kind is OpKind.OPT:
                    self._optimizer_step(current)
                    if current.sync and self.sync_hook is not None:
                        self.sync_hook(current)
                    continue
                inputs = {m: self.channel.wait(m) for m in op_recvs(current, layout)}
                if current.kind in POST_VALIDATION_KINDS:
                    if current.kind is OpKind.PSTEP:
                        self._all_reduce_data_parallel_grads()
                    outputs = run_post_validation_op(self.worker, current, inputs, self.outcomes)
                else:
                    outputs = run_compute_op(self.worker, current, inputs)
                for msg, tensor in outputs.items():
                    self.channel.send(msg, tensor)
                if current.kind is OpKind.VALIDATE and self.cadence.due(current.update):
                    self.sink.submit(self.worker.take_report(current.update), replica=self.groups.dp_rank)
            current = None
            self.channel.flush()
        except PipelineRuntimeError as exc:
            raise PipelineRuntimeError(self._where(current) + str(exc)) from exc
        except Exception as exc:
            raise PipelineRuntimeError(self._where(current) + f"{type(exc).__name__}: {exc}") from exc

    def _where(self, op: Op | None) -> str:
        what = f"at {op}" if op is not None else "while draining sends"
        return f"stage {self.groups.stage} (rank {self.groups.rank}) {what}: "


class SideChannelReports:
    """Ships every rank's :class:`StageReport` to the logging rank over a gloo side group.

    Non-logging ranks ``isend`` and move on. The logging rank is stage 0 / replica 0: in
    every schedule here stage 0 is the last to finish an update, so the others' reports
    for that update have already been sent when it collects them.
    """

    def __init__(self, groups: StageGroups, collector: "ReportSink | None", timeout: timedelta, logging_rank: int = 0):
        self.groups = groups
        self.collector = collector
        self.timeout = timeout
        self.logging_rank = logging_rank
        self._sends = SendReaper(timeout, threaded=True)  # the side group is gloo

    def submit(self, report: StageReport, replica: int) -> None:
        if self.groups.rank != self.logging_rank:
            t = report.to_tensor()
            work = dist.isend(t, dst=self.logging_rank, group=self.groups.reports)
            self._sends.add(self.logging_rank, work, t, f"the statistics of update {report.update}")
            return
        assert self.collector is not None
        self.collector.submit(report, replica)
        for rank in range(self.groups.layout.world_size):
            if rank == self.logging_rank:
                continue
            buf = torch.empty(StageReport.size(), dtype=torch.float64)
            work = dist.irecv(buf, src=rank, group=self.groups.reports)
            stage = self.groups.layout.coords(rank)[0]
            wait_or_raise(work, self.timeout, f"collecting statistics of update {report.update} from stage {stage} (rank {rank})")
            self.collector.submit(StageReport.from_tensor(buf), self.groups.layout.coords(rank)[1])

    def flush(self) -> None:
        self._sends.flush()
