"""What runs around a stage's ops besides the op itself: its tracer and its profiler.

Why a holder of its own: a worker owns its instruments from construction
(``StageWorker(..., tracer=..., profiler=...)``), yet each is on for part of a run only --
tracing during training segments (not evaluation), profiling until a profiled Zero Bubble
schedule has decided its order. Their owners (the runner, the profiling hook) switch them
through these methods instead of assigning worker attributes from outside, and the executors
read them per op: with both off, that is one attribute check (:attr:`OpHooks.on`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron.pipeline.runtime.op_profiler import OpProfiler
    from megatron.pipeline.runtime.tracing import StageTracer


class OpHooks:
    """One stage's tracer and profiler, each None while off."""

    __slots__ = ("_tracer", "_profiler", "on")

    def __init__(self, tracer: StageTracer | None = None, profiler: OpProfiler | None = None):
        self._tracer = tracer
        self._profiler = profiler
        #: Whether any instrument is on: the executors' per-op check (a plain attribute, kept
        #: by the switches below, so that an uninstrumented op pays no property call).
        self.on = tracer is not None or profiler is not None

    @property
    def tracer(self) -> StageTracer | None:
        """Records op spans (``--trace-dir``, :mod:`megatron.pipeline.runtime.tracing`)."""
        return self._tracer

    @property
    def profiler(self) -> OpProfiler | None:
        """Times F / B / W (:mod:`megatron.pipeline.runtime.profiling`)."""
        return self._profiler

    def start_tracing(self, tracer: StageTracer) -> None:
        """Record the following ops on ``tracer`` (a training segment begins)."""
        self._tracer = tracer
        self.on = True

    def stop_tracing(self) -> StageTracer | None:
        """Stop recording; return the tracer that was on (None: none was)."""
        tracer, self._tracer = self._tracer, None
        self.on = self._profiler is not None
        return tracer

    def start_profiling(self, profiler: OpProfiler) -> None:
        """Time the following F / B / W ops on ``profiler``."""
        self._profiler = profiler
        self.on = True

    def stop_profiling(self) -> OpProfiler | None:
        """Stop timing; return the profiler that was on (None: none was)."""
        profiler, self._profiler = self._profiler, None
        self.on = self._tracer is not None
        return profiler
