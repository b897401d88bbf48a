"""The simulator's overlap factor for DualPipeV's F&B slots (megatron/pipeline/overlap.py).

References worked out by hand: the saving of one slot from its window, and DualPipeV's
makespan as stage 0's busy time plus DualPipe's README bubble ``(P/2 - 1)(F&B + B - 3W)``
(``P = 2p``), with ``F&B = F + BW - a min(F, BW)``. Stage ``r`` runs ``2m - 3p + r + 1``
overlapped slots (phase 4: ``2(m - 2p + r + 1)``, phase 5: ``p - r - 1``), each shorter by
``a min(F, BW)`` when both of its inputs are there when it starts.
"""
from __future__ import annotations

import json
import math

import pytest

from megatron.pipeline.ir import OpKind
from megatron.pipeline.overlap import check_overlap, overlap_saving
from megatron.pipeline.schedules import ScheduleConfig, build_schedule
from megatron.pipeline.simulator import OpCosts, simulate_schedule


def _dualpipev(p: int, m: int):
    return build_schedule("dualpipev", ScheduleConfig(p, m, num_iterations=1))


@pytest.mark.parametrize("factor, forward, ready, backward, saved", [
    (1.0, (0, 1), 0.0, 2.0, 1.0),  # both ready at the start: max(F, BW) = 2 instead of 3
    (0.5, (0, 1), 0.0, 2.0, 0.5),
    (1.0, (0, 3), 0.0, 1.0, 1.0),  # a short backward hides entirely behind the forward
    (1.0, (2, 3), 2.75, 2.0, 0.25),  # its input arrives with a quarter of the forward left
    (1.0, (2, 3), 3.5, 2.0, 0.0),  # after the forward: nothing to overlap
    (0.0, (0, 1), 0.0, 2.0, 0.0),  # serial
])
def test_the_saving_of_one_slot(factor, forward, ready, backward, saved) -> None:
    assert overlap_saving(factor, *forward, ready, backward) == saved


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan])
def test_factors_outside_zero_one_are_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="overlap factor must be in"):
        check_overlap(bad)


@pytest.mark.parametrize("p, m", [(4, 8), (4, 16)])
def test_each_stage_runs_the_slots_it_should(p: int, m: int) -> None:
    schedule = _dualpipev(p, m)
    for r, stream in enumerate(schedule.streams()):
        ops = list(stream)
        slots = [op for op in ops if schedule.policy.overlapped_backward(op)]
        assert len(slots) == 2 * m - 3 * p + r + 1
        for op in slots:  # each right after the other chunk's forward
            before = ops[ops.index(op) - 1]
            assert op.kind is OpKind.BW and before.kind is OpKind.F and before.chunk == 1 - op.chunk


@pytest.mark.parametrize("costs", [OpCosts(), OpCosts(t_f=2, t_b=1, t_w=0.5)], ids=["equal", "f2-b1-w0.5"])
@pytest.mark.parametrize("factor", [0.0, 1.0])
@pytest.mark.parametrize("p, k", [(2, 2), (4, 2), (4, 4), (8, 2)])
def test_dualpipev_makespan_is_stage_zeros_work_plus_the_readme_bubble(costs: OpCosts, factor: float,
                                                                      p: int, k: int) -> None:
    m, f, b, w = k * p, costs.t_f, costs.t_b, costs.t_w
    saving = factor * min(f, b + w)
    busy0 = 2 * m * (f + b + w) - (2 * m - 3 * p + 1) * saving
    bubble = (p - 1) * ((f + b + w - saving) + b - 3 * w)
    result = simulate_schedule(_dualpipev(p, m), costs, overlap=factor)
    assert result.busy[0] == busy0 and result.makespan == busy0 + bubble  # all terms are dyadic


def test_a_factor_changes_nothing_without_overlapped_slots() -> None:
    zbv = build_schedule("zb-v", ScheduleConfig(4, 8, num_iterations=1))
    assert simulate_schedule(zbv, overlap=1.0).spans == simulate_schedule(zbv).spans
    assert simulate_schedule(_dualpipev(4, 8), overlap=0.0).spans == simulate_schedule(_dualpipev(4, 8)).spans


def test_the_tool_takes_the_factor(capsys: pytest.CaptureFixture[str]) -> None:
    from tools.simulate_schedule import main

    base = ["--schedule", "dualpipev", "--stages", "2", "--microbatches", "4", "--json"]
    assert main([*base, "--overlap-factor", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["overlap_factor"] == 1.0 and out["makespan"] == 21.0  # 24 - 3 slots on stage 0
    assert main([*base, "--overlap-factor", "2"]) == 2
    assert "overlap factor must be in [0, 1]" in capsys.readouterr().err
