"""Per-stage op traces of real runs (``--trace-dir DIR``).

Why: the timing simulator predicts where a schedule idles; a trace shows where a real run
idled, in the same terms, so the two can be compared op by op (``tools/merge_traces.py``).

What is recorded, per stage and data-parallel replica: every compute op (F, B, W, BW, EVAL;
hooked in :func:`megatron.pipeline.runtime.executors.common.run_compute_op`) and every optimizer step
(hooked in :meth:`megatron.pipeline.runtime.worker.StageWorker.apply_update`), as
``(kind, micro-batch, chunk, update, sync, start_ns, end_ns)`` from ``time.time_ns()``.

* Ops are timed *after* their inputs were received and *before* their outputs are sent
  (sends are non-blocking), so a receive wait is idle time, as in the simulator.
* A synchronous step is timed from after its collective (the global-norm all-gather, the
  data-parallel all-reduce) to its end: the wait for the slowest stage is idle time, as in
  the simulator, where a ``sync`` OPT starts once every stage is free.
* On CUDA the device is synchronised after each traced op, so a span is the op's execution,
  not its launch (only while tracing).
* Clock: ``time.time_ns()`` is common to all processes of a host, so ranks of one host are
  merged on their raw timestamps. The distributed runner also records ``align_ns`` right
  after a barrier at the start of each traced segment; ranks on different hosts (``host``)
  are aligned on their first one, as wall clocks of two hosts can differ by milliseconds.
* Off (the default), the cost is one attribute check per op.

Optimizer post-validation ops (PSTEP, VALIDATE, DISCARD, DRAIN) are not traced yet.

File ``DIR/stage{S}_dp{D}.json``, written at the end of every training segment (cumulative);
its fields are described in :mod:`megatron.pipeline.trace_format`.

In the emulator all stages run one after another in one process: its timestamps are that
serial execution (the merge tool re-times emulator traces through the replay engine).
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch

from megatron.pipeline.ir import Op, PipelineLayout
from megatron.pipeline.trace_format import TRACE_FORMAT, TRACE_VERSION, trace_file_name


class StageTracer:
    """The recorded ops of one stage (one data-parallel replica)."""

    def __init__(self, stage: int, dp_rank: int, layout: PipelineLayout, executor: str,
                 schedule: str, microbatches_per_update: int, device: torch.device | None = None):
        self.stage, self.dp_rank, self.layout = stage, dp_rank, layout
        self.executor, self.schedule = executor, schedule
        self.microbatches_per_update = microbatches_per_update
        self._cuda = device if device is not None and device.type == "cuda" else None
        self.ops: list[list[Any]] = []
        self.align_ns: list[int] = []

    @staticmethod
    def now() -> int:
        return time.time_ns()

    def record(self, op: Op, start_ns: int) -> None:
        """Record ``op`` as running from ``start_ns`` until now."""
        if self._cuda is not None:
            torch.cuda.synchronize(self._cuda)
        self.ops.append([op.kind.value, op.microbatch, op.chunk, op.update, op.sync, start_ns, time.time_ns()])

    def mark_aligned(self) -> None:
        """Call right after a barrier every rank passes: a common reference instant."""
        self.align_ns.append(time.time_ns())

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": TRACE_FORMAT, "version": TRACE_VERSION, "stage": self.stage, "dp_rank": self.dp_rank,
            "host": socket.gethostname(), "executor": self.executor, "schedule": self.schedule, "num_stages": self.layout.num_stages,
            "num_chunks": self.layout.num_chunks, "layout": type(self.layout).__name__,
            "microbatches_per_update": self.microbatches_per_update, "clock": "time_ns",
            "align_ns": self.align_ns, "ops": self.ops,
        }

    def write(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``directory/stage{S}_dp{D}.json`` atomically (rename), so a reader never sees half a file."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        out = path / trace_file_name(self.stage, self.dp_rank)
        tmp = out.with_suffix(f".json.tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), separators=(",", ":")))
        tmp.replace(out)
        return out

