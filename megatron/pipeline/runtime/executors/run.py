"""Run op streams on the local stages with the executor of the transport.

Both executors drive the same :class:`~megatron.pipeline.runtime.executors.core.OpCore`; they
differ only in how streams advance, which follows from where the stages live.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from megatron.pipeline.ir import Op
from megatron.pipeline.schedules.zero_bubble.post_validation import ValidationOutcomes
from megatron.pipeline.schedules.zero_bubble.tied_exchange import with_tied_exchange
from megatron.pipeline.runtime.executors.common import ReportCadence, ReportSink
from megatron.pipeline.runtime.executors.core import SyncHook, UpdateHook
from megatron.pipeline.runtime.executors.distributed import DistributedExecutor
from megatron.pipeline.runtime.executors.emulator import Emulator
from megatron.pipeline.runtime.transport import Transport
from megatron.pipeline.runtime.transport.distributed import DistributedTransport
from megatron.pipeline.runtime.transport.in_process import InProcessTransport
from megatron.pipeline.runtime.tied_embeddings import tied_parameters
from megatron.pipeline.runtime.worker import StageWorker


def run_streams(transport: Transport, workers: Sequence[StageWorker], streams: Sequence[Iterable[Op]],
                cadence: ReportCadence, sink: ReportSink, sync_hook: SyncHook | None = None,
                outcomes: ValidationOutcomes | None = None, after_update: UpdateHook | None = None) -> None:
    """Run ``streams`` (one per local stage, in :attr:`Transport.stages` order) to their ends.

    A stage holding an end of a tied embedding whose other end is on another stage sums the
    two gradients before each post-validated step: its stream gets the exchange's ops
    (:func:`~megatron.pipeline.schedules.zero_bubble.tied_exchange.with_tied_exchange`)."""
    streams = [with_tied_exchange(stream, w.stage, transport.layout) if tied_parameters(w.setup.chunks) else stream
               for w, stream in zip(workers, streams, strict=True)]
    if transport.in_process:  # every stage here: replay interleaves them
        assert isinstance(transport, InProcessTransport)
        Emulator(list(workers), transport.layout, cadence, sink, sync_hook, outcomes, transport,
                 after_update).run(list(streams))
        return
    assert isinstance(transport, DistributedTransport)
    (worker,), (stream,) = workers, streams  # one stage per process
    DistributedExecutor(worker, transport, cadence, sink, sync_hook=sync_hook, outcomes=outcomes,
                        after_update=after_update).run(stream)
