"""Timing one stage's F / B / W ops while a profiled Zero Bubble schedule profiles.

What is measured and how the measurements become a schedule's costs is described in
:mod:`megatron.pipeline.runtime.profiling`; this module is the measuring part alone, which a
worker's :class:`~megatron.pipeline.runtime.op_hooks.OpHooks` hold, so that the worker (and
the executors that run its ops) never depend on the deciding part.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator

import torch

from megatron.pipeline.ir import Op, OpKind
from megatron.pipeline.runtime.memory import ActivationMeter

_TIMED = (OpKind.F, OpKind.B, OpKind.W)
# The fixed-length summary a rank contributes to the all-gather (seconds, ratio, counts).
SUMMARY_FIELDS = ("t_f", "t_b", "t_w", "m_w", "t_comm", "n_f", "n_b", "n_w")


class OpProfiler:
    """Wall times of one stage's F / B / W ops and the M_W / M_B ratio of its Bs."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: dict[OpKind, list[float]] = {k: [] for k in _TIMED}
        self.bytes_forward = 0  # what the profiled Bs' micro-batches held before B (their F's)
        self.bytes_kept = 0  # what they still held after B, for W
        self.t_comm = 0.0  # set by the executor's hook (ping-pong or clone time)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def timed(self, op: Op, meter: ActivationMeter) -> Iterator[None]:
        if op.kind not in self.times:
            yield
            return
        key = (op.microbatch, op.chunk)
        before = meter.live_bytes(key)
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.times[op.kind].append(time.perf_counter() - start)
        if op.kind is OpKind.B:
            self.bytes_forward += before
            self.bytes_kept += meter.live_bytes(key)

    def summary(self) -> list[float]:
        """This stage's measurements in :data:`SUMMARY_FIELDS` order (seconds)."""
        med = {k: statistics.median(v) if v else 0.0 for k, v in self.times.items()}
        m_w = self.bytes_kept / self.bytes_forward if self.bytes_forward else 0.0
        return [med[OpKind.F], med[OpKind.B], med[OpKind.W], min(1.0, m_w), self.t_comm,
                float(len(self.times[OpKind.F])), float(len(self.times[OpKind.B])), float(len(self.times[OpKind.W]))]
