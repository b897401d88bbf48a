"""What the stages of a run exchange, whether they share this process or not.

One driver, one runner and one op-execution core (:mod:`~megatron.pipeline.runtime.executors.core`)
run every schedule; only *where the stages live* differs, and that is this protocol:

* :class:`~.in_process.InProcessTransport` (the emulator): every stage in this process, one
  data-parallel replica; a collective is a loop over the local stages, a message a tensor clone;
* :class:`~.distributed.DistributedTransport` (the runtime): this rank's stage, torch.distributed
  P2P with receives posted ahead, collectives over the rank's process groups.

Both compute every collective's result in the same order (squared norms in stage order summed
with ``math.fsum``, AMDP replica sums in pipeline order), which is why the emulator is bitwise
the runtime. Later parallelism (tensor parallel, a sharded optimizer, bucketed overlapped
gradient reduction) belongs here once, behind :meth:`Transport.reduce_data_parallel` and the
step's collectives (:meth:`Transport.sync_gather`, :meth:`Transport.replica_gather`), instead
of in two executors; what the step computes from them is written once in
:mod:`~megatron.pipeline.runtime.executors.core` and :mod:`~megatron.pipeline.runtime.replicas`.
"""
from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    import torch

    from megatron.pipeline.ir import Op, PipelineLayout
    from megatron.pipeline.runtime.report import StageReport
    from megatron.pipeline.runtime.tracing import StageTracer
    from megatron.pipeline.runtime.worker import StageWorker
    from megatron.pipeline.schedules.base import Schedule


class ReportSink(Protocol):
    def submit(self, report: "StageReport", replica: int) -> None: ...


Workers = Mapping[int, "StageWorker"] | Sequence["StageWorker"]
"""The local stages' workers, indexed by stage (a list when every stage is local)."""


class Transport(abc.ABC):
    """Where stages live and how they reach each other; see the module docstring."""

    name: str  # "emulator" or "distributed": trace files and the start banner say which
    in_process: bool  # every stage here: streams advance by replay, not by prefetching receives

    # -- who is here ---------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def stages(self) -> tuple[int, ...]:
        """The stages whose workers live in this process, increasing."""

    rank: int = 0
    dp_rank: int = 0
    # Tensor-parallel rank within the stage: TP peers run the same ops on the same data, so
    # only TP rank 0 contributes to sums of per-stage results (reports, evaluation losses).
    tp_rank: int = 0
    pipeline_size: int
    data_parallel_size: int = 1

    @property
    def is_coordinator(self) -> bool:
        """The rank that logs, prints, stages and publishes checkpoints (rank 0)."""
        return self.rank == 0

    @property
    @abc.abstractmethod
    def num_reporters(self) -> int:
        """How many stage reports make one update's statistics (stages x replicas)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """The start banner's words for this executor."""

    @abc.abstractmethod
    def local_streams(self, schedule: "Schedule") -> list["Iterable[Op]"]:
        """The op streams of :attr:`stages`, in that order."""

    # -- the workers -----------------------------------------------------------------------
    def attach(self, worker: "StageWorker") -> None:
        """Hand a freshly built local ``worker`` what depends on this process's groups (the
        distributed optimizer's group, overlapped gradient buckets); called once, where the
        worker is built. Default: nothing to hand over (one process holds every stage)."""

    # -- the optimizer step's collectives ------------------------------------------------
    layout: "PipelineLayout"  # where the schedule puts chunks (sync groups, AMDP's replicas)

    @abc.abstractmethod
    def reduce_data_parallel(self, worker: "StageWorker") -> None:
        """Average the stage's gradients over its data-parallel replicas (before any norm)."""

    @abc.abstractmethod
    def sync_gather(self, values: Sequence[float], device: "torch.device") -> list[float]:
        """The local stages' ``values`` (one per op of a synchronous step) and those of the rest
        of their sync group, in the group's stage order (float64; ``device``: NCCL's)."""

    def sum_tied_gradients(self, workers: Workers, ops: "Sequence[Op]") -> None:
        """Before a synchronous step: every tied end (embedding, output-layer copy) of the
        local stages of ``ops``, and of the other holders, gets the sum of their gradients
        (:mod:`~megatron.pipeline.runtime.tied_embeddings`). Here: every holder is local."""
        from megatron.pipeline.runtime.tied_embeddings import sum_tied_gradients, tied_parameters

        sum_tied_gradients([p for op in ops for p in tied_parameters(workers[op.stage].setup.chunks)],
                           self.tied_all_reduce())

    def tied_all_reduce(self) -> "Callable[[torch.Tensor], None] | None":
        """The sum over the other processes holding a tied end (None: all are in this one)."""
        return None

    @abc.abstractmethod
    def replica_gather(self, stage: int, local: Mapping[tuple[int, int], "torch.Tensor"]) -> list["torch.Tensor"]:
        """Logical ``stage``'s equally shaped tensors from all its AMDP replicas, in pipeline
        order; ``local`` holds the local replicas' ones by (device, chunk)."""

    # -- statistics, evaluation, checkpoints, stopping ----------------------------------
    @abc.abstractmethod
    def report_sink(self, collector: ReportSink | None) -> ReportSink:
        """Where stage reports go: ``collector`` on the logging rank (None elsewhere)."""

    def flush(self) -> None:
        """Wait until every report and message this process sent has been received."""

    @abc.abstractmethod
    def all_sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over processes (evaluation's loss and token sums)."""

    @abc.abstractmethod
    def all_max(self, values: Sequence[float]) -> list[float]:
        """Element-wise maximum over processes (the stop agreement)."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Every process reaches this point (checkpoint staging, writing, publishing)."""

    @abc.abstractmethod
    def gather_rows(self, rows: Mapping[int, Sequence[float]]) -> list[tuple[int, list[float]]]:
        """Every process's ``{stage: row}`` as (stage, row) pairs, the same list everywhere
        (float64: profiled costs, parameter counts, a schedule's fingerprint)."""

    @abc.abstractmethod
    def link_latency(self, worker: "StageWorker") -> float:
        """One-way time of one activation-sized message from ``worker``'s stage (profiling);
        every local stage calls it at the same synchronous step."""

    def align_clocks(self, tracers: Sequence["StageTracer"]) -> None:
        """Give the tracers a common reference instant (processes' clocks differ)."""
