"""The runtime's transport: this rank's stage, torch.distributed point-to-point and collectives.

Point-to-point goes over one two-rank group per link direction (:class:`P2PChannel`, receives
posted ahead into recycled buffers, sends never copied and reaped by
:mod:`~megatron.pipeline.runtime.executors.send_reaper`);
collectives over the rank's :class:`~megatron.pipeline.runtime.parallel.StageGroups`: the
step's norms over the pipeline (or AMDP's sync group), gradients over the data-parallel group,
statistics, sums, barriers and gathers over the gloo side group (never NCCL: CPU tensors).
Every wait has the pipeline timeout, so a dead peer ends a rank instead of hanging it.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from megatron.pipeline.comm import Message
from megatron.pipeline.ir import MultiPipelineLayout, Op, PipelineLayout
from megatron.pipeline.runtime.executors.send_reaper import SendReaper, wait_or_raise
from megatron.pipeline.runtime.parallel import DataParallelGroup, StageGroups, has_replicas
from megatron.pipeline.runtime.report import StageReport
from megatron.pipeline.runtime.transport import ReportSink, Transport
from megatron.pipeline.runtime.transport.recv_buffers import ReceiveBuffers

if TYPE_CHECKING:
    from megatron.pipeline.runtime.stage_setup import StageSetup
    from megatron.pipeline.runtime.tracing import StageTracer
    from megatron.pipeline.schedules.base import Schedule

PING_ROUNDS = 5


class Receiver(Protocol):
    """What a channel needs of its stage (a worker is one): the shape and dtype of each message
    it receives, and the setup's device, where receive buffers live."""

    @property
    def setup(self) -> StageSetup: ...

    def recv_spec(self, msg: Message) -> tuple[tuple[int, ...], torch.dtype]: ...


class P2PChannel:
    """Point-to-point messages of one stage, with receives posted ahead of use.

    Receives go into recycled buffers (:class:`~.recv_buffers.ReceiveBuffers`: reused only
    once nothing references them). Sends never copy: a contiguous tensor is sent as it is
    (stages produce contiguous outputs; a non-contiguous one is copied once, as gloo and NCCL
    need contiguous memory), and a stage sending to itself hands the tensor over without a
    clone (the sender keeps no reference it writes to: an activation is ``out.detach()``, a
    gradient ``x.grad`` of a popped stash, a post-validation state a fresh tensor; an in-place
    write by the receiver would fail autograd's version check on either side, as it would on
    a received buffer). Each send and receive is one unbatched ``isend``/``irecv`` on its
    direction's two-rank group: ``batch_isend_irecv`` takes ops of one group only, and gloo
    runs a batch as the same calls in a loop (docs/gpu.md section 1, docs/benchmarks_history.md).
    """

    #: Recycle receive buffers (benchmarks switch it off before the ranks fork to compare).
    reuse_receive_buffers: bool = True

    def __init__(self, stage: Receiver, groups: StageGroups, timeout: timedelta):
        self.stage = stage
        self.groups = groups
        self.timeout = timeout
        self.buffers = ReceiveBuffers(reuse=self.reuse_receive_buffers)
        # Posted receives per message, oldest first: a post-validation rerun receives the
        # same activation twice (a stale copy to DRAIN, then the re-sent one).
        self._posted: dict[Message, deque[tuple[dist.Work | None, torch.Tensor]]] = {}
        self._local: dict[Message, torch.Tensor] = {}  # stage sending to itself
        self._sends = SendReaper(timeout, threaded=stage.setup.device.type == "cpu")

    def _peer(self, stage: int) -> int:
        return self.groups.peer(stage)

    def post(self, msg: Message) -> None:
        if msg.src_stage == msg.dst_stage:
            return
        shape, dtype = self.stage.recv_spec(msg)
        buf = self.buffers.take(shape, dtype, self.stage.setup.device)
        group = self.groups.p2p_group(msg.src_stage, msg.dst_stage, msg.lane)
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
        return self.buffers.lend(buf)

    def send(self, msg: Message, tensor: torch.Tensor) -> None:
        if msg.src_stage == msg.dst_stage:
            self._local[msg] = tensor  # no clone: see the class docstring
            return
        tensor = tensor.contiguous()  # a no-op (no copy) for the contiguous tensors stages produce
        peer = self._peer(msg.dst_stage)
        group = self.groups.p2p_group(msg.src_stage, msg.dst_stage, msg.lane)
        self._sends.add(peer, dist.isend(tensor, dst=peer, group=group), tensor, msg)

    def flush(self) -> None:
        self._sends.flush()


class SideChannelReports:
    """Ships every reporting rank's :class:`StageReport` to the logging rank over a gloo side group.

    Non-logging ranks ``isend`` and move on. The logging rank is stage 0 / replica 0: at
    :meth:`submit` it only posts the receives of the others' reports; :meth:`collect` waits
    for them and hands the update to the collector (the logger). The runtime collects after
    the logging rank's next compute op (and at the end of every run), not at the step: stage 0
    starts the next iteration's first forward, which every other stage is waiting for, right
    after its step instead of after the slowest stage's step, the report's trip and the log
    line (the others send their reports right after their own step, so the wait is over by
    then). Only tensor-parallel rank 0 of each (stage, replica) reports: its TP peers computed
    the same loss (vocab-parallel cross-entropy is reduced over the group) and the same
    TP-reduced norms, so the log is the TP = 1 log.
    """

    def __init__(self, groups: StageGroups, collector: ReportSink | None, timeout: timedelta, logging_rank: int = 0):
        self.groups = groups
        self.collector = collector
        self.timeout = timeout
        self.logging_rank = logging_rank
        self._sends = SendReaper(timeout, threaded=True)  # the side group is gloo
        # Logging rank: submitted updates whose other reports are still to be waited for, in
        # order: (own report, its replica, [(rank, buffer, receive)]).
        self._pending: list[tuple[StageReport, int, list[tuple[int, torch.Tensor, dist.Work]]]] = []

    def submit(self, report: StageReport, replica: int) -> None:
        if self.groups.tp_rank != 0:
            return
        if self.groups.rank != self.logging_rank:
            t = report.to_tensor()
            work = dist.isend(t, dst=self.logging_rank, group=self.groups.reports)
            self._sends.add(self.logging_rank, work, t, f"the statistics of update {report.update}")
            return
        assert self.collector is not None
        receives = []
        for rank in reporting_ranks(self.groups):
            if rank != self.logging_rank:
                buf = torch.empty(StageReport.size(), dtype=torch.float64)
                receives.append((rank, buf, dist.irecv(buf, src=rank, group=self.groups.reports)))
        self._pending.append((report, replica, receives))

    def collect(self) -> None:
        """Wait for the posted reports and submit every pending update, in order (logging rank)."""
        pending, self._pending = self._pending, []
        for report, replica, receives in pending:
            assert self.collector is not None
            self.collector.submit(report, replica)
            for rank, buf, work in receives:
                stage, other_replica = self.groups.layout.coords(rank)[:2]
                wait_or_raise(work, self.timeout, f"collecting statistics of update {report.update} from stage {stage} (rank {rank})")
                self.collector.submit(StageReport.from_tensor(buf), other_replica)

    def flush(self) -> None:
        self.collect()
        self._sends.flush()


def reporting_ranks(groups: StageGroups) -> list[int]:
    """The ranks whose reports make an update's statistics: TP rank 0 of every (stage, replica)."""
    return [r for r in range(groups.layout.world_size) if groups.layout.coords(r)[2] == 0]


class DistributedTransport(Transport):
    name = "distributed"
    in_process = False

    def __init__(self, groups: StageGroups, layout: PipelineLayout, timeout: timedelta):
        self.groups = groups
        self.layout = layout
        self.timeout = timeout
        self.rank, self.dp_rank, self.tp_rank = groups.rank, groups.dp_rank, groups.tp_rank
        self.pipeline_size = groups.layout.pipeline_size
        self.data_parallel_size = groups.layout.data_parallel_size
        self.data_parallel_group = DataParallelGroup(groups.data_parallel, self.data_parallel_size, timeout)
        # The sync step's group: AMDP's (the devices holding replicas of the same stages), else
        # the pipeline (one chain: every stage).
        self._sync = (groups.sync, groups.sync_size) if has_replicas(layout) else \
            (groups.pipeline, len(layout.sync_group(groups.stage)))
        self._reports: SideChannelReports | None = None

    @property
    def stages(self) -> tuple[int, ...]:
        return (self.groups.stage,)

    @property
    def num_reporters(self) -> int:
        return len(reporting_ranks(self.groups))

    def describe(self) -> str:
        return f"distributed runtime, {self.groups.layout.world_size} ranks"

    def local_streams(self, schedule: "Schedule") -> list[Iterable[Op]]:
        return [schedule.stage_ops(self.groups.stage)]

    def channel(self, stage: Receiver) -> P2PChannel:
        """This stage's point-to-point messages (one channel per executor run)."""
        return P2PChannel(stage, self.groups, self.timeout)

    # -- the optimizer step ------------------------------------------------------------
    def sync_gather(self, values: Sequence[float], device: torch.device) -> list[float]:
        group, size = self._sync
        if size == 1:
            return [float(v) for v in values]
        mine = torch.tensor(list(values), dtype=torch.float64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(gathered, mine, group=group)
        return [float(t) for t in gathered]  # a group orders its ranks by stage: stage order

    def tied_all_reduce(self) -> Callable[[torch.Tensor], None] | None:
        group = self.groups.embedding
        if group is None:  # this rank holds both ends (or neither): nothing to exchange
            return None
        return lambda total: dist.all_reduce(total, group=group)

    def replica_gather(self, stage: int, local: Mapping[tuple[int, int], torch.Tensor]) -> list[torch.Tensor]:
        assert isinstance(self.layout, MultiPipelineLayout)
        (mine,) = local.values()
        gathered = [torch.empty_like(mine) for _ in range(self.layout.num_pipelines)]
        dist.all_gather(gathered, mine, group=self.groups.replicas[stage])
        replicas = self.layout.replicas(stage)
        by_device = dict(zip(sorted(d for d, _ in replicas), gathered))  # a group orders by rank
        return [by_device[d] for d, _ in replicas]

    # -- side group ----------------------------------------------------------------------
    def report_sink(self, collector: ReportSink | None) -> ReportSink:
        self._reports = SideChannelReports(self.groups, collector, self.timeout)
        return self._reports

    def flush(self) -> None:
        if self._reports is not None:
            self._reports.flush()

    def collect_reports(self) -> None:
        """Log the updates whose reports were submitted and not yet collected (see
        :class:`SideChannelReports`); a no-op off the logging rank."""
        if self._reports is not None:
            self._reports.collect()

    def _all_reduce(self, values: Sequence[float], op: dist.ReduceOp) -> list[float]:
        self.collect_reports()  # the side group's pending receives come first
        tensor = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(tensor, op=op, group=self.groups.reports)
        return tensor.tolist()

    def all_sum(self, values: Sequence[float]) -> list[float]:
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def all_max(self, values: Sequence[float]) -> list[float]:
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def barrier(self) -> None:
        self.collect_reports()
        dist.barrier(group=self.groups.reports)

    def gather_rows(self, rows: Mapping[int, Sequence[float]]) -> list[tuple[int, list[float]]]:
        (row,) = rows.values()
        self.collect_reports()
        mine = torch.tensor([float(x) for x in row], dtype=torch.float64)
        out = [torch.empty_like(mine) for _ in range(self.groups.layout.world_size)]
        dist.all_gather(out, mine, group=self.groups.reports, async_op=True).wait(self.timeout)
        return [(self.groups.layout.coords(r)[0], t.tolist()) for r, t in enumerate(out)]

    def link_latency(self, probe: torch.Tensor) -> float:
        """One-way time of ``probe`` between this stage and the next (0 on the last stage).

        Neighbouring pairs take turns (pair (0, 1), then (1, 2), ...), each ``PING_ROUNDS``
        timed round trips after one untimed.
        """
        n, stage = self.groups.layout.pipeline_size, self.groups.stage
        buf, device = probe, probe.device

        def wait(work: "dist.Work") -> None:
            work.wait(self.timeout)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        hop = 0.0
        for left in range(n - 1):
            if stage == left:
                peer = self.groups.peer(left + 1)
                times = []
                for _ in range(PING_ROUNDS + 1):
                    start = time.perf_counter()
                    wait(dist.isend(buf, dst=peer))
                    wait(dist.irecv(buf, src=peer))
                    times.append(time.perf_counter() - start)
                hop = statistics.median(times[1:]) / 2
            elif stage == left + 1:
                peer = self.groups.peer(left)
                for _ in range(PING_ROUNDS + 1):
                    wait(dist.irecv(buf, src=peer))
                    wait(dist.isend(buf, dst=peer))
        return hop

    def align_clocks(self, tracers: Sequence["StageTracer"]) -> None:
        self.barrier()  # a common instant for aligning the ranks' clocks
        for tracer in tracers:
            tracer.mark_aligned()
