"""Per-rank timelines of one iteration, ours and the peer's, on the same terms (``--timeline``).

Why: a throughput ratio says who is faster, not why. Both runtimes run the same stage modules,
so a gap must show as either longer ops (compute: forward, backward) or more time between them
(idle: waiting for a peer, the step, bookkeeping). This module records the peer's ops
(``torch.distributed.pipelining``'s ``forward_one_chunk`` / ``backward_one_chunk``, the clip
and the optimizer step) the way our ``--trace-dir`` records ours, and reduces both to the same
per-rank, per-iteration breakdown: period, forward and backward ms per micro-batch, step ms,
idle ms (period minus the rank's ops), and, for the peer, the rank's thread CPU time per
iteration (load-robust: a stolen core inflates wall time, not CPU time).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Span = tuple[str, float, float]  # (kind: "F" | "B" | "W" | "STEP", start ms, end ms), one clock for all ranks


def now_ms() -> float:
    """Wall clock shared by every process of the host (our traces stamp ``time.time_ns``)."""
    return time.time_ns() / 1e6


def cpu_ms() -> float:
    """This thread's CPU time: what an op costs whatever else the host runs."""
    return time.thread_time_ns() / 1e6


class PeerRecorder:
    """Spans of one peer rank's ops, and its thread CPU time per iteration."""

    def __init__(self) -> None:
        self.iterations: list[list[Span]] = []
        self.cpu_iterations: list[list[Span]] = []  # the same ops on the thread's CPU clock
        self.cpu_ms: list[float] = []
        self._cpu0 = 0.0

    def wrap(self, stage: Any) -> None:
        """Time ``stage``'s compute methods (instance attributes shadow the class's)."""
        for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
            if hasattr(stage, name):
                setattr(stage, name, self._timed(getattr(stage, name), kind))

    def _timed(self, fn: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start, cpu = now_ms(), cpu_ms()
            try:
                return fn(*args, **kwargs)
            finally:
                self.iterations[-1].append((kind, start, now_ms()))
                self.cpu_iterations[-1].append((kind, cpu, cpu_ms()))
        return run

    def begin(self) -> None:
        self.iterations.append([])
        self.cpu_iterations.append([])
        self._cpu0 = cpu_ms()

    def step(self, start: float, cpu_start: float) -> None:
        """The clip and optimizer step, from ``start`` (``cpu_start`` on the CPU clock) to now;
        ends the iteration."""
        self.iterations[-1].append(("STEP", start, now_ms()))
        self.cpu_iterations[-1].append(("STEP", cpu_start, cpu_ms()))
        self.cpu_ms.append(cpu_ms() - self._cpu0)


def ours_iterations(trace_dir: Path) -> dict[int, list[list[Span]]]:
    """Our ranks' traced ops grouped by update (F/B/W/BW by micro-batch, OPT by its update)."""
    import json

    from megatron.pipeline.trace_format import TRACE_FILE_GLOB

    out: dict[int, list[list[Span]]] = {}
    for f in sorted(trace_dir.glob(TRACE_FILE_GLOB)):
        data = json.loads(f.read_text())
        ops = data["ops"]
        m = int(data["microbatches_per_update"])
        by_update: dict[int, list[Span]] = {}
        for kind, mb, _chunk, update, _sync, start, end in ops:
            it = update if kind == "OPT" else mb // m
            label = {"OPT": "STEP", "BW": "B"}.get(kind, kind)
            by_update.setdefault(it, []).append((label, start / 1e6, end / 1e6))
        out[int(data["stage"])] = [by_update[k] for k in sorted(by_update)]
    return out


@dataclass
class Breakdown:
    """Medians over the steady iterations of one rank (ms)."""

    period: float
    fwd: float  # per forward op
    bwd: float  # backward (B + W where split) per forward op
    step: float
    idle: float  # period minus every op of the rank
    cpu: float | None  # thread CPU per iteration (peer only)

    def row(self) -> str:
        cpu = f"{self.cpu:.0f}" if self.cpu is not None else "-"
        return f"{self.period:7.0f} {self.fwd:6.1f} {self.bwd:6.1f} {self.step:6.1f} {self.idle:6.0f} {cpu:>6}"


def breakdown(iterations: Sequence[list[Span]], skip: int, cpu_ms: Sequence[float] = ()) -> Breakdown:
    """Reduce one rank's iterations (the first ``skip`` left out) to its :class:`Breakdown`.
    An iteration's period runs from the previous iteration's step end to its own step end."""
    periods, fwd, bwd, step, idle = [], [], [], [], []
    for k in range(max(1, skip), len(iterations)):
        spans, prev = iterations[k], iterations[k - 1]
        period = max(e for *_, e in spans) - max(e for *_, e in prev)
        busy = sum(e - s for _, s, e in spans)
        periods.append(period)
        idle.append(period - busy)
        fwd.extend(e - s for kind, s, e in spans if kind == "F")
        n_f = max(1, sum(1 for kind, *_ in spans if kind == "F"))
        bwd.append(sum(e - s for kind, s, e in spans if kind in ("B", "W")) / n_f)
        step.append(sum(e - s for kind, s, e in spans if kind == "STEP"))
    med = statistics.median
    cpu = med(cpu_ms[max(1, skip):]) if len(cpu_ms) > skip else None
    return Breakdown(med(periods), med(fwd), med(bwd), med(step), med(idle), cpu)


HEADER = "    side rank  period    fwd    bwd   step   idle    cpu   (ms; fwd/bwd per forward op, the rest per iteration)"


def report(side: str, per_rank: dict[int, list[list[Span]]], skip: int, cpu: dict[int, list[float]] | None = None) -> list[str]:
    return [f"{side:>8} {rank:4d} {breakdown(its, skip, (cpu or {}).get(rank, ())).row()}"
            for rank, its in sorted(per_rank.items())]
