"""Reading run traces (``--trace-dir``): Chrome trace events, measured bubbles, re-timing.

Why a library next to the simulator: a measured bubble is only comparable with a simulated
one if both use the same definition, so :func:`stage_bubbles` applies the simulator's
(:mod:`megatron.pipeline.simulator`) to measured spans, and :func:`simulate_trace` feeds the
simulator the *recorded* op streams with the *measured* per-stage op costs, so that what is
left between the two is jitter (op times that vary around their median, uneven latencies),
not a different schedule or different op costs. The runtime's measured per-op dispatch time
and message latency are part of the simulated costs.

Definition (the simulator's, per stage): ``span`` runs from the start of the stage's first
op to the end of its last op, where a final synchronous OPT counts as starting right after
the op before it (the wait in front of the run's last collective is not the schedule's);
``busy`` is the sum of op durations; ``bubble = span - busy``; bubble fraction
``bubble / span``. The run's bubble rate is ``(max span - max busy) / max span``.
"""
from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.pipeline.comm import Message, op_recvs, op_sends
from megatron.pipeline.ir import MultiPipelineLayout, Op, OpKind, PipelineLayout, VShapeLayout
from megatron.pipeline.replay import ReplayEngine
from megatron.pipeline.costs.op_costs import OpCosts
from megatron.pipeline.simulator import OpSpan, SimulationResult, simulate_streams
from megatron.pipeline.trace_format import TRACE_FILE_GLOB, TRACE_FORMAT

NS_PER_MS = 1e6


@dataclass
class StageTrace:
    """One rank's trace: its ops with spans in ms from the run's common origin."""

    stage: int
    dp_rank: int
    meta: dict[str, Any]
    spans: list[OpSpan]

    @property
    def executor(self) -> str:
        return str(self.meta.get("executor", "distributed"))


def load_traces(directory: str | Path) -> list[StageTrace]:
    """Every ``stage*_dp*.json`` of ``directory``, on one time axis (ms, 0 = first op start).

    Ranks of one host keep their raw ``time.time_ns()`` stamps (one clock: exact). Ranks on
    several hosts are aligned on their first ``align_ns`` (taken right after a common barrier),
    which is good to the barrier's exit skew.
    """
    files = sorted(Path(directory).glob(TRACE_FILE_GLOB))
    if not files:
        raise FileNotFoundError(f"{directory}: no {TRACE_FILE_GLOB} trace files")
    raw = []
    for f in files:
        data = json.loads(f.read_text())
        if data.get("format") != TRACE_FORMAT:
            raise ValueError(f"{f}: not a {TRACE_FORMAT} file")
        raw.append(data)
    aligned = len({d.get("host") for d in raw}) > 1 and all(d.get("align_ns") for d in raw)
    ref = min(d["align_ns"][0] for d in raw) if aligned else 0
    offsets = [(d["align_ns"][0] - ref) if aligned else 0 for d in raw]
    origin = min((op[5] - off for d, off in zip(raw, offsets) for op in d["ops"]), default=0)
    traces = []
    for d, off in zip(raw, offsets):
        spans = [
            OpSpan((start - off - origin) / NS_PER_MS, (end - off - origin) / NS_PER_MS,
                   Op(OpKind(kind), d["stage"], mb, chunk, update, bool(sync)))
            for kind, mb, chunk, update, sync, start, end in d["ops"]
        ]
        traces.append(StageTrace(d["stage"], d["dp_rank"], {k: v for k, v in d.items() if k != "ops"}, spans))
    traces.sort(key=lambda t: (t.dp_rank, t.stage))
    return traces


def layout_of(traces: Sequence[StageTrace]) -> PipelineLayout:
    meta = traces[0].meta
    layouts = {cls.__name__: cls for cls in (MultiPipelineLayout, VShapeLayout)}
    cls = layouts.get(meta.get("layout", ""), PipelineLayout)
    return cls(int(meta["num_stages"]), int(meta["num_chunks"]))


def replica(traces: Sequence[StageTrace], dp_rank: int = 0) -> list[StageTrace]:
    """The stages of one data-parallel replica, in stage order (all of them must be present)."""
    picked = sorted((t for t in traces if t.dp_rank == dp_rank), key=lambda t: t.stage)
    n = int(traces[0].meta["num_stages"])
    if [t.stage for t in picked] != list(range(n)):
        raise ValueError(f"replica {dp_rank}: traces of stages {[t.stage for t in picked]}, need 0..{n - 1}")
    return picked


def skip_iterations(spans: Sequence[OpSpan], iterations: int, microbatches_per_update: int) -> list[OpSpan]:
    """Drop the ops of the first ``iterations`` updates (start-up, first-touch allocations).

    An op belongs to update ``mb // a`` (OPTs to their own update). The kept ops of all stages
    still form complete streams: every message of a kept op comes from a kept op.
    """
    if iterations <= 0:
        return list(spans)
    first = iterations * microbatches_per_update
    return [sp for sp in spans
            if (sp.op.update >= iterations if sp.op.kind is OpKind.OPT else sp.op.microbatch >= first)]


# ------------------------------------------------------------------ bubbles


@dataclass(frozen=True)
class StageBubble:
    busy: float
    span: float

    @property
    def bubble(self) -> float:
        return self.span - self.busy

    @property
    def fraction(self) -> float:
        return self.bubble / self.span if self.span > 0 else 0.0


def stage_bubble(spans: Sequence[OpSpan]) -> StageBubble:
    """One stage's busy time and span, by the simulator's definition (module docstring)."""
    if not spans:
        return StageBubble(0.0, 0.0)
    busy = sum(sp.end - sp.start for sp in spans)
    last = spans[-1]
    last_end = last.end
    if last.op.kind is OpKind.OPT and last.op.sync:
        before = spans[-2].end if len(spans) > 1 else last.start
        last_end = before + (last.end - last.start)
    return StageBubble(busy, last_end - spans[0].start)


def bubble_rate(bubbles: Sequence[StageBubble]) -> float:
    """Zero Bubble's ``(cost - ideal) / cost`` over stages (the simulator's ``bubble_rate``)."""
    cost = max((b.span for b in bubbles), default=0.0)
    ideal = max((b.busy for b in bubbles), default=0.0)
    return (cost - ideal) / cost if cost > 0 else 0.0


# ------------------------------------------------------------------ re-timing and simulation


def retime(stage_spans: Sequence[Sequence[OpSpan]], layout: PipelineLayout) -> list[list[OpSpan]]:
    """The timeline the recorded ops would have on one device per stage: each op keeps its
    measured duration, and starts when its stage is free and its inputs have arrived (the
    simulator's replay with zero communication time). For emulator traces, whose timestamps
    are one process running all stages in turn."""
    durations = {id_: [sp.end - sp.start for sp in spans] for id_, spans in enumerate(stage_spans)}
    cursor = [0] * len(stage_spans)
    free = [0.0] * len(stage_spans)
    out: list[list[OpSpan]] = [[] for _ in stage_spans]

    def take(stage: int, op: Op, start: float) -> float:
        duration = durations[stage][cursor[stage]]
        cursor[stage] += 1
        out[stage].append(OpSpan(start, start + duration, op))
        free[stage] = start + duration
        return start + duration

    class _Arrival(dict):
        def __init__(self, t: float):
            super().__init__()
            self.t = t

        def __contains__(self, msg: object) -> bool:
            return True

        def __getitem__(self, msg: object) -> float:
            return self.t

    def execute(op: Op, inputs: dict[Message, Any]) -> dict[Message, Any]:
        start = max([free[op.stage], *inputs.values()])
        return _Arrival(take(op.stage, op, start))

    def execute_sync(ops: list[Op]) -> None:
        start = max(free[op.stage] for op in ops)
        for op in ops:
            take(op.stage, op, start)

    streams = [[sp.op for sp in spans] for spans in stage_spans]
    ReplayEngine(streams, layout, execute, execute_sync).run()
    return out


def send_times(stage_spans: Sequence[Sequence[OpSpan]], layout: PipelineLayout) -> dict[Message, float]:
    """When each message was sent: the end of its sending op's span."""
    return {msg: sp.end for spans in stage_spans for sp in spans for msg in op_sends(sp.op, layout)}


def message_latency(stage_spans: Sequence[Sequence[OpSpan]], layout: PipelineLayout) -> float:
    """Median time from the end of a sending op to the start of the receiving op, over the
    receives the receiver was idle for (its previous op had ended before the message was
    sent): what a message costs end to end on this runtime -- the link plus waking the
    receiver. This is the simulator's ``t_comm``. 0 when no receive waited."""
    sent = send_times(stage_spans, layout)
    samples = []
    for spans in stage_spans:
        for prev, sp in zip([None, *spans[:-1]], spans):
            for msg in op_recvs(sp.op, layout):
                t = sent.get(msg)
                if t is not None and (prev is None or prev.end <= t) and sp.start >= t:
                    samples.append(sp.start - t)
    return statistics.median(samples) if samples else 0.0


def dispatch_overhead(stage_spans: Sequence[Sequence[OpSpan]], layout: PipelineLayout) -> list[float]:
    """Per stage, the median gap between two consecutive ops when the second waited for nothing
    (its messages had been sent before the first ended; not a synchronous step): the runtime's
    own time between ops (posting receives, sends, bookkeeping), outside any op's span."""
    sent = send_times(stage_spans, layout)
    out = []
    for spans in stage_spans:
        gaps = []
        for prev, sp in zip(spans, spans[1:]):
            if sp.op.kind is OpKind.OPT and sp.op.sync:
                continue
            if all(sent.get(msg, math.inf) <= prev.end for msg in op_recvs(sp.op, layout)):
                gaps.append(max(0.0, sp.start - prev.end))
        out.append(statistics.median(gaps) if gaps else 0.0)
    return out


def measured_costs(stage_spans: Sequence[Sequence[OpSpan]], t_comm: float = 0.0,
                   overhead: Sequence[float] | None = None) -> tuple[OpCosts, ...]:
    """Per-stage median op durations (ms) by kind, plus the stage's per-op ``overhead``, as
    simulator costs (a kind a stage never ran: 0)."""
    costs = []
    for s, spans in enumerate(stage_spans):
        extra = overhead[s] if overhead is not None else 0.0
        by_kind: dict[OpKind, list[float]] = {}
        for sp in spans:
            by_kind.setdefault(sp.op.kind, []).append(sp.end - sp.start)
        med = {k: statistics.median(v) + extra for k, v in by_kind.items()}
        costs.append(OpCosts(t_f=med.get(OpKind.F, 0.0), t_b=med.get(OpKind.B, 0.0), t_w=med.get(OpKind.W, 0.0),
                             t_bw=med.get(OpKind.BW, 0.0), t_opt=med.get(OpKind.OPT, 0.0), t_comm=t_comm))
    return tuple(costs)


@dataclass
class TraceSimulation:
    """The simulator on a trace's op streams; ``bubble_fraction`` per stage counts the per-op
    dispatch overhead as idle, as the trace does (it lies between op spans there)."""

    result: SimulationResult
    t_comm: float
    overhead: list[float]
    bubble_fraction: list[float]
    bubble_rate: float


def simulate_trace(stage_spans: Sequence[Sequence[OpSpan]], layout: PipelineLayout,
                   t_comm: float | None = None, overhead: Sequence[float] | None = None) -> TraceSimulation:
    """The simulator on the recorded op streams, each op costing its stage's measured median
    duration plus the stage's dispatch overhead (:func:`dispatch_overhead`), messages the
    measured latency (:func:`message_latency`); defaults measured from the trace itself."""
    streams = [[sp.op for sp in spans] for spans in stage_spans]
    if t_comm is None:
        t_comm = message_latency(stage_spans, layout)
    over = list(overhead) if overhead is not None else dispatch_overhead(stage_spans, layout)
    result = simulate_streams(streams, layout, measured_costs(stage_spans, t_comm, over))
    busy = [b - len(spans) * o for b, spans, o in zip(result.busy, result.spans, over)]
    fractions = [(span - b) / span if span > 0 else 0.0 for span, b in zip(result.stage_span, busy)]
    cost = max(result.stage_span, default=0.0)
    rate = (cost - max(busy, default=0.0)) / cost if cost > 0 else 0.0
    return TraceSimulation(result, t_comm, over, fractions, rate)


def as_result(stage_spans: Sequence[Sequence[OpSpan]]) -> SimulationResult:
    """Measured spans in the simulator's result type (for drawing with its timeline code)."""
    spans = [list(s) for s in stage_spans]
    bubbles = [stage_bubble(s) for s in spans]
    makespan = max((s[-1].end for s in spans if s), default=0.0)
    n = len(spans)
    return SimulationResult(spans, makespan, [b.busy for b in bubbles], [b.span for b in bubbles],
                            [0.0] * n, [{} for _ in range(n)])


# ------------------------------------------------------------------ Chrome / Perfetto


def chrome_trace(traces: Iterable[StageTrace]) -> dict[str, Any]:
    """Chrome trace-event JSON (``chrome://tracing``, https://ui.perfetto.dev): one process per
    stage, one thread per data-parallel replica, one complete ("X") event per op, in µs."""
    events: list[dict[str, Any]] = []
    for t in traces:
        events.append({"name": "process_name", "ph": "M", "pid": t.stage, "tid": t.dp_rank, "ts": 0,
                       "args": {"name": f"stage {t.stage}"}})
        events.append({"name": "thread_name", "ph": "M", "pid": t.stage, "tid": t.dp_rank, "ts": 0,
                       "args": {"name": f"dp {t.dp_rank} ({t.executor})"}})
        for sp in t.spans:
            op = sp.op
            name = f"OPT#{op.update}" if op.kind is OpKind.OPT else f"{op.kind.value}{op.microbatch}"
            if op.chunk and op.kind is not OpKind.OPT:
                name += f".c{op.chunk}"
            events.append({"name": name, "cat": op.kind.value, "ph": "X", "pid": t.stage, "tid": t.dp_rank,
                           "ts": round(sp.start * 1e3, 3), "dur": round((sp.end - sp.start) * 1e3, 3),
                           "args": {"microbatch": op.microbatch, "chunk": op.chunk, "update": op.update,
                                    "sync": op.sync}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
