"""The simulator's runtime terms (``t_send``, ``t_sync``) against hand-computed timelines, and
their calibration from a trace (:mod:`megatron.pipeline.costs.calibration`): a trace made from a
simulated timeline with known terms gives those terms back.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from megatron.pipeline.costs.calibration import (
    Calibration,
    RuntimeTerms,
    calibrate,
    mean_per_iteration,
    median_calibration,
)
from megatron.pipeline.comm import op_sends
from megatron.pipeline.ir import BW, F, OPT, OpKind, PipelineLayout
from megatron.pipeline.schedules import ScheduleConfig, build_schedule
from megatron.pipeline.costs.op_costs import OpCosts
from megatron.pipeline.simulator import OpSpan, simulate_schedule, simulate_streams

REPO = Path(__file__).resolve().parents[1]


def simulate(name: str, n: int, m: int, costs: OpCosts, iterations: int = 1):
    return simulate_schedule(build_schedule(name, ScheduleConfig(n, m, num_iterations=iterations)), costs)


def test_send_cost_occupies_the_sender_but_the_message_leaves_at_compute_end() -> None:
    # GPipe, N = 2, m = 2: stage 0 runs F0, F1 back to back, each followed by an isend call.
    r = simulate("gpipe", 2, 2, OpCosts(t_f=1.0, t_b=1.0, t_w=1.0, t_send=0.25))
    s0 = [(sp.start, sp.end) for sp in r.spans[0] if sp.op.kind is OpKind.F]
    s1 = [sp.start for sp in r.spans[1] if sp.op.kind is OpKind.F]
    assert s0 == [(0.0, 1.25), (1.25, 2.5)]
    assert s1 == [1.0, 2.25]  # F1's activation arrives at its compute end, 2.25, not 2.5


@pytest.mark.parametrize("t_opt, t_sync", [(0.0, 0.0), (0.1, 0.3), (0.0, 2.0)])
def test_two_stage_1f1b_one_microbatch(t_opt: float, t_sync: float) -> None:
    t_f, t_bw, c, s = 1.0, 2.0, 0.5, 0.25
    r = simulate("1f1b", 2, 1, OpCosts(t_f=t_f, t_b=1.0, t_w=1.0, t_comm=c, t_send=s, t_opt=t_opt, t_sync=t_sync))
    # F0 on stage 0, trip, F0 and BW0 on stage 1, trip, BW0 on stage 0, then the synchronous
    # step; stage 1's send calls (after its BW0) end before stage 0's BW0 does.
    assert r.makespan == pytest.approx(2 * t_f + 2 * t_bw + 2 * c + t_opt + t_sync)
    assert r.busy[1] == pytest.approx(t_f + t_bw + s + t_opt + t_sync)  # F on the last stage sends nothing
    assert r.busy[0] == pytest.approx(t_f + s + t_bw + t_opt + t_sync)  # BW on stage 0 sends nothing


def test_send_cost_on_the_critical_path_of_1f1b() -> None:
    # N = 2, m = 2, t_f = 1, t_bw = 2, t_comm = 0. Without sends: stage 1 F0 [1,2] BW0 [2,4]
    # F1 [4,5] BW1 [5,7]; stage 0 BW0 [4,6] BW1 [7,9]: makespan 9. With t_send = 0.5 stage 1's
    # F1 waits for the call after BW0 (starts 4.5), so BW1 ends 7.5 (+0.5 call) and stage 0's
    # BW1 runs [7.5, 9.5]; the step then adds t_opt + t_sync.
    base = OpCosts(t_f=1.0, t_b=1.0, t_w=1.0, t_opt=0.25, t_sync=1.0)
    assert simulate("1f1b", 2, 2, base).makespan == pytest.approx(9.0 + 1.25)
    with_send = simulate("1f1b", 2, 2, OpCosts(t_f=1.0, t_b=1.0, t_w=1.0, t_send=0.5, t_opt=0.25, t_sync=1.0))
    assert with_send.makespan == pytest.approx(9.5 + 1.25)
    bw1 = next(sp for sp in with_send.spans[1] if sp.op.kind is OpKind.BW and sp.op.microbatch == 1)
    assert (bw1.start, bw1.end) == pytest.approx((5.5, 8.0))


def test_sync_term_applies_to_synchronous_steps_only() -> None:
    layout = PipelineLayout(1, 1)
    costs = OpCosts(t_f=1.0, t_b=1.0, t_w=1.0, t_opt=0.5, t_sync=3.0)
    local = simulate_streams([[F(0, 0), BW(0, 0), OPT(0, 0, sync=False)]], layout, costs)
    collective = simulate_streams([[F(0, 0), BW(0, 0), OPT(0, 0, sync=True)]], layout, costs)
    assert local.makespan == pytest.approx(3.5)
    assert collective.makespan == pytest.approx(6.5)


def test_a_message_to_the_same_stage_costs_no_send() -> None:
    layout = PipelineLayout(1, 2)  # two chunks on one stage: chunk 0 hands its output to chunk 1 locally
    stream = [F(0, 0, 0), F(0, 0, 1), BW(0, 0, 1), BW(0, 0, 0)]
    assert any(op_sends(op, layout) for op in stream)
    r = simulate_streams([stream], layout, OpCosts(t_f=1.0, t_b=1.0, t_w=1.0, t_send=5.0))
    assert r.makespan == pytest.approx(6.0)


def test_runtime_terms_apply_per_op_once_per_fused_backward() -> None:
    costs = RuntimeTerms(per_op=0.5, t_send=0.25, t_comm=0.125, t_sync=4.0).apply(OpCosts(t_f=2.0, t_b=3.0, t_w=1.0, t_opt=0.1))
    assert (costs.t_f, costs.t_b, costs.t_w, costs.fused_backward) == (2.5, 3.5, 1.5, 4.5)
    assert (costs.t_send, costs.t_comm, costs.t_sync, costs.t_opt) == (0.25, 0.125, 4.0, 0.1)


def as_trace(spans: list[list[OpSpan]], layout: PipelineLayout, t_send: float) -> list[list[OpSpan]]:
    """What the runtime's tracer would record for a simulated timeline: an op's span ends
    before its send calls (``megatron.pipeline.runtime.tracing``)."""
    def traced_end(sp: OpSpan) -> float:
        if sp.op.kind is OpKind.OPT:
            return sp.end
        return sp.end - t_send * sum(1 for msg in op_sends(sp.op, layout) if msg.dst_stage != sp.op.stage)
    return [[OpSpan(sp.start, traced_end(sp), sp.op) for sp in stage] for stage in spans]


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_calibration_recovers_the_terms_of_a_known_timeline(name: str) -> None:
    sleeps = OpCosts(t_f=20.0, t_b=20.0, t_w=20.0)
    truth = RuntimeTerms(per_op=1.5, t_send=0.5, t_comm=0.375, t_sync=7.0)
    schedule = build_schedule(name, ScheduleConfig(4, 3, num_iterations=4))
    sim = simulate_schedule(schedule, truth.apply(sleeps))
    cal = calibrate(as_trace(sim.spans, schedule.layout, truth.t_send), schedule.layout, sleeps, log_interval=2)
    assert cal.gap == pytest.approx(0.0, abs=1e-9)
    assert (cal.per_op_at_depth, cal.t_send, cal.t_comm, cal.t_sync) == pytest.approx(
        (truth.per_op, truth.t_send, truth.t_comm, truth.t_sync))
    assert cal.samples["sync_steps"] == 3 and cal.samples["trips"] > 0 and cal.samples["gaps_after_send"] > 0


def test_logging_steps_are_averaged_per_phase() -> None:
    # phase 0 (u = 0, 2, 4): median 2; phase 1 (u = 1, 3, 5): median 6; an outlier per phase is ignored
    assert mean_per_iteration({0: 1.0, 1: 5.0, 2: 2.0, 3: 6.0, 4: 90.0, 5: 70.0}, 2) == pytest.approx(4.0)
    assert mean_per_iteration({}, 2) == 0.0


def test_median_of_repeated_calibrations() -> None:
    runs = [Calibration(gap=g, t_send=s, t_comm=0.3, t_sync=y, per_op_at_depth=1.0, latency=0.3, samples={"ops": 10})
            for g, s, y in [(0.1, 0.4, 5.0), (0.0, 0.6, 50.0), (0.2, 0.5, 6.0)]]
    med = median_calibration(runs)
    assert (med.gap, med.t_send, med.t_sync) == pytest.approx((0.1, 0.5, 6.0))
    assert med.samples == {"ops": 30}
    with pytest.raises(ValueError):
        median_calibration([])


def _load_harness():
    spec = importlib.util.spec_from_file_location("zero_bubble_synthetic", REPO / "benchmarks" / "zero_bubble_synthetic.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)  # puts benchmarks/ on sys.path for its own imports
    return module


def test_harness_predictions_use_the_calibrated_terms() -> None:
    zb = _load_harness()
    costs = zb.CostSet(1.0, 1.0, 1.0)
    terms = RuntimeTerms(per_op=0.5, t_send=0.25, t_comm=0.5, t_sync=3.0)
    # 1F1B, N = 2, m = 1: 2 (t_f + o) + 2 (t_bw + o) + 2 t_comm + t_sync (test_two_stage_1f1b_one_microbatch)
    sync = zb.Result("1f1b", 2, 1, False, 1.0, 1.0, 12, 2, wgrad_ms=1.0)
    got = zb.predict(sync, costs, RuntimeTerms(), terms)
    assert (got["sim_ms"], got["sim_ovh_ms"], got["sim_cal_ms"]) == pytest.approx((6.0, 6.0, 3.0 + 5.0 + 1.0 + 3.0))
    # PACI (stage-local steps, no flush, no steady-state bubble with equal stages): one update
    # is m (t_f + t_bw + 2 o) in the steady state; t_sync does not apply to its local steps.
    paci = zb.Result("paci", 2, 2, True, 1.0, 1.0, 12, 2, wgrad_ms=1.0)
    got = zb.predict(paci, costs, RuntimeTerms(), RuntimeTerms(per_op=0.5, t_sync=3.0))
    assert got["sim_ms"] == pytest.approx(2 * 3.0)
    assert got["sim_cal_ms"] == pytest.approx(2 * (3.0 + 2 * 0.5))
