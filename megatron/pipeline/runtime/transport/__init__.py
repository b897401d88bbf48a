"""What the stages of a run exchange, whether they share this process or not.

One driver, one runner and one op-execution core (:mod:`~megatron.pipeline.runtime.executors.core`)
run every schedule; only *where the stages live* differs, and that is this protocol:

* :class:`~.in_process.InProcessTransport` (the emulator): every stage in this process, one
  data-parallel replica; a collective is a loop over the local stages, a message a tensor clone;
* :class:`~.distributed.DistributedTransport` (the runtime): this rank's stage, torch.distributed
  P2P with receives posted ahead, collectives over the rank's process groups.

Both compute every collective's result in the same order (squared norms in stage order summed
with ``math.fsum``, AMDP replica sums in pipeline order), which is why the emulator is bitwise
the runtime. A transport moves tensors and provides the step's collectives
(:meth:`Transport.sync_gather`, :meth:`Transport.replica_gather`,
:meth:`Transport.tied_all_reduce`); it knows nothing of workers (what a channel needs of a
stage is :class:`~.distributed.Receiver`). What the step computes from the collectives is
written once in :mod:`~megatron.pipeline.runtime.executors.core` and
:mod:`~megatron.pipeline.runtime.replicas`; the data-parallel gradient reduction is the
worker's :class:`~megatron.pipeline.runtime.gradient_sync.GradientSync`, over the group the
transport describes (:attr:`Transport.data_parallel_group`).
"""
from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    import torch

    from megatron.pipeline.ir import Op, PipelineLayout
    from megatron.pipeline.runtime.parallel import DataParallelGroup
    from megatron.pipeline.runtime.report import StageReport
    from megatron.pipeline.runtime.tracing import StageTracer
    from megatron.pipeline.schedules.base import Schedule


class ReportSink(Protocol):
    def submit(self, report: "StageReport", replica: int) -> None: ...


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

    #: The local stage's data-parallel replicas, which its gradients are averaged over (by the
    #: worker's :class:`~megatron.pipeline.runtime.gradient_sync.GradientSync`); None: this
    #: process holds the only replica and there is nothing to reduce.
    data_parallel_group: "DataParallelGroup | None" = None

    # -- the optimizer step's collectives ------------------------------------------------
    layout: "PipelineLayout"  # where the schedule puts chunks (sync groups, AMDP's replicas)

    @abc.abstractmethod
    def sync_gather(self, values: Sequence[float], device: "torch.device") -> list[float]:
        """The local stages' ``values`` (one per op of a synchronous step) and those of the rest
        of their sync group, in the group's stage order (float64; ``device``: NCCL's)."""

    def tied_all_reduce(self) -> "Callable[[torch.Tensor], None] | None":
        """The sum over the other processes holding a tied end (embedding, output-layer copy;
        :mod:`~megatron.pipeline.runtime.tied_embeddings`); None: all are in this one."""
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
    def link_latency(self, probe: "torch.Tensor") -> float:
        """One-way time of a message like ``probe`` (an activation of a local stage, on its
        device) from that stage (profiling); every local stage calls it at the same synchronous
        step. ``probe``'s values may be overwritten."""

    def align_clocks(self, tracers: Sequence["StageTracer"]) -> None:
        """Give the tracers a common reference instant (processes' clocks differ)."""
