"""The simulator's runtime terms, measured from the trace of a short calibration run.

Why: the simulator's nominal op costs leave out what the distributed runtime adds around the
ops: the per-op dispatch, the ``isend`` call on every op that sends, the message's trip and the
receiver's wake-up, and the synchronous step's collectives (norm all-gather over the N ranks,
stage 0 collecting the other stages' statistics). The last ones grow with the pipeline depth N,
so they have to be measured *at* depth N. ``benchmarks/calibrate_runtime.py`` runs a short
traced run at depth N (``--trace-dir``; a run separate from the ones a prediction is compared
with) and this module turns its trace into :class:`RuntimeTerms`. Every term is a difference of
timestamps in that trace; none is solved from a measured iteration time.

Terms (ms), over the traced ops after the warm-up iterations (the trace records an op after its
inputs were received and before its outputs are sent, :mod:`megatron.pipeline.runtime.tracing`):

* ``gap``: median idle time between two consecutive ops of a stage when the second waited for
  nothing (each of its messages was sent at least one median trip before the first op ended)
  and the first sent nothing: the executor's own time between ops. It is part of the
  per-op cost ``per_op`` that the N = 1 baseline measures, so it is only used to separate the
  other terms from it.
* ``t_send``: median gap after an op that sent a message (the second op again waited for
  nothing), minus ``gap``: what handing a message to the transport costs the sender.
* ``t_comm``: median *trip*, the time from the end of a sending op to the start of the
  receiving op, over receives the receiver was idle for (its previous op ended before the
  message was sent and sent nothing itself, so no ``isend`` call of its own delayed it), minus
  ``gap``. In the simulator an op lasts its sleep plus ``per_op`` (which contains one
  ``gap``) and its message arrives ``t_comm`` after that; a measured trip from traced end to
  traced start contains one ``gap`` and ``t_comm``. It does not contain ``t_send``: the
  receiver has the data before the sender's ``isend`` call returns (measured: the trip,
  ~0.3 ms, is shorter than the call, ~0.5 ms), so the call delays the sender's next op only.
* ``t_sync``: per synchronous step, from the end of the last compute op of the update on any
  stage to the start of the first compute op of the next update on any stage: the collective,
  the optimizer step and the statistics, all stages being ready. Steps that collect statistics
  (every ``log_interval``-th) cost more, so the median is taken per phase of the log interval
  and the phases are averaged: the mean cost per iteration.
* ``per_op_at_depth``: median of (traced duration - nominal sleep) over compute ops, plus
  ``gap``: the per-op cost at depth N, next to the N = 1 baseline's, as a check of CPU
  oversubscription (N ranks on fewer cores stretch ops only if this is larger).

Pure (no torch), like the simulator.
"""
from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megatron.pipeline.comm import op_recvs, op_sends
from megatron.pipeline.ir import Op, OpKind, PipelineLayout
from megatron.pipeline.costs.op_costs import OpCosts
from megatron.pipeline.simulator import OpSpan
from megatron.pipeline.trace_analysis import send_times


@dataclass(frozen=True)
class RuntimeTerms:
    """What the runtime adds to nominal op costs (ms): ``per_op`` on every compute op (from an
    N = 1 run), ``t_send`` / ``t_comm`` per message and ``t_sync`` per synchronous step."""

    per_op: float = 0.0
    t_send: float = 0.0
    t_comm: float = 0.0
    t_sync: float = 0.0

    def apply(self, nominal: OpCosts) -> OpCosts:
        """``nominal`` with these terms added (a fused BW is one op: one ``per_op``)."""
        o = self.per_op
        return dataclasses.replace(
            nominal, t_f=nominal.t_f + o, t_b=nominal.t_b + o, t_w=nominal.t_w + o,
            t_bw=nominal.fused_backward + o, t_comm=self.t_comm, t_send=self.t_send, t_sync=self.t_sync)


@dataclass(frozen=True)
class Calibration:
    """The terms measured from one calibration trace, with the raw quantities behind them."""

    gap: float
    t_send: float
    t_comm: float
    t_sync: float
    per_op_at_depth: float
    latency: float  # median traced end-of-sender to start-of-receiver
    samples: Mapping[str, int]  # how many gaps / steps each median is over

    def terms(self, per_op: float) -> RuntimeTerms:
        """The simulator's terms with the per-op cost ``per_op`` (the N = 1 baseline's)."""
        return RuntimeTerms(per_op, self.t_send, self.t_comm, self.t_sync)


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def _sends_elsewhere(op: Op, layout: PipelineLayout) -> bool:
    return any(msg.dst_stage != op.stage for msg in op_sends(op, layout))


def idle_trips(stage_spans: Sequence[Sequence[OpSpan]], layout: PipelineLayout) -> list[float]:
    """Traced end of a sending op to traced start of its receiver, for receivers that were idle
    when the message was sent and whose previous op sent nothing (or that had no previous op)."""
    sent = send_times(stage_spans, layout)
    trips = []
    for spans in stage_spans:
        for prev, sp in zip([None, *spans[:-1]], spans):
            if sp.op.kind is OpKind.OPT:
                continue
            if prev is not None and (prev.op.kind is OpKind.OPT or _sends_elsewhere(prev.op, layout)):
                continue
            for msg in op_recvs(sp.op, layout):
                t = sent.get(msg)
                if t is not None and (prev is None or prev.end <= t) and sp.start >= t:
                    trips.append(sp.start - t)
    return trips


def idle_gaps(stage_spans: Sequence[Sequence[OpSpan]], layout: PipelineLayout,
              trip: float = 0.0) -> tuple[list[float], list[float]]:
    """Gaps between consecutive compute ops of a stage whose second op waited for nothing (each
    of its messages was sent at least ``trip`` before the first op ended), split by whether the
    first op sent a message to another stage: ``(after a send, after no send)``."""
    sent = send_times(stage_spans, layout)
    after_send: list[float] = []
    after_none: list[float] = []
    for spans in stage_spans:
        for prev, sp in zip(spans, spans[1:]):
            if prev.op.kind is OpKind.OPT or sp.op.kind is OpKind.OPT:
                continue
            if all(sent.get(msg, float("inf")) + trip <= prev.end for msg in op_recvs(sp.op, layout)):
                gap = max(0.0, sp.start - prev.end)
                (after_send if _sends_elsewhere(prev.op, layout) else after_none).append(gap)
    return after_send, after_none


def sync_step_latencies(stage_spans: Sequence[Sequence[OpSpan]]) -> dict[int, float]:
    """Per synchronous update ``u`` followed by more compute: the first compute op start after
    the step minus the last compute op end before it, over all stages."""
    last_end: dict[int, float] = {}
    next_start: dict[int, float] = {}
    for spans in stage_spans:
        for i, sp in enumerate(spans):
            if sp.op.kind is not OpKind.OPT or not sp.op.sync:
                continue
            u = sp.op.update
            before = next((p for p in reversed(spans[:i]) if p.op.kind is not OpKind.OPT), None)
            after = next((p for p in spans[i + 1:] if p.op.kind is not OpKind.OPT), None)
            if before is not None:
                last_end[u] = max(last_end.get(u, before.end), before.end)
            if after is not None:
                next_start[u] = min(next_start.get(u, after.start), after.start)
    return {u: next_start[u] - last_end[u] for u in sorted(last_end) if u in next_start}


def mean_per_iteration(per_update: Mapping[int, float], log_interval: int) -> float:
    """Median per phase ``u % log_interval`` (logging steps cost more), averaged over phases."""
    phases: dict[int, list[float]] = {}
    for u, v in per_update.items():
        phases.setdefault(u % max(1, log_interval), []).append(v)
    return statistics.fmean(statistics.median(v) for v in phases.values()) if phases else 0.0


def calibrate(stage_spans: Sequence[Sequence[OpSpan]], layout: PipelineLayout, sleeps: OpCosts,
              log_interval: int) -> Calibration:
    """:class:`Calibration` from a trace's spans (ms, warm-up already dropped); ``sleeps`` are
    the nominal op costs the run slept."""
    trips = idle_trips(stage_spans, layout)
    latency = _median(trips)
    after_send, after_none = idle_gaps(stage_spans, layout, latency)
    gap = _median(after_none)
    t_send = max(0.0, _median(after_send) - gap) if after_send else 0.0
    t_comm = max(0.0, latency - gap)
    steps = sync_step_latencies(stage_spans)
    extra = [sp.end - sp.start - sleeps.duration(sp.op.kind)
             for spans in stage_spans for sp in spans if sp.op.kind is not OpKind.OPT]
    return Calibration(
        gap=gap, t_send=t_send, t_comm=t_comm, t_sync=mean_per_iteration(steps, log_interval),
        per_op_at_depth=_median(extra) + gap, latency=latency,
        samples={"trips": len(trips), "gaps_after_send": len(after_send), "gaps_after_no_send": len(after_none),
                 "sync_steps": len(steps), "ops": len(extra)})


def median_calibration(runs: Sequence[Calibration]) -> Calibration:
    """Term-wise median of repeated calibrations (interleaved with other runs on a loaded host)."""
    if not runs:
        raise ValueError("no calibration runs")
    med = {f.name: statistics.median(getattr(r, f.name) for r in runs)
           for f in dataclasses.fields(Calibration) if f.name != "samples"}
    samples = {k: sum(r.samples.get(k, 0) for r in runs) for k in runs[0].samples}
    return Calibration(**med, samples=samples)


__all__ = ["Calibration", "RuntimeTerms", "calibrate", "idle_gaps", "idle_trips", "mean_per_iteration",
           "median_calibration", "sync_step_latencies"]
