"""ZB-V's search with T_F, T_B, T_W unequal, against the controllable-memory paper's claims
(``shared/specs/v_schedules.md`` next to the repository) in the simulator.

* At 1F1B's activation memory (zb-v's default limit, ``2p`` chunk activations = ``p`` whole
  stages) its bubble rate is at most 1F1B-flush's. Costs are per V chunk; 1F1B's stage holds
  both chunks' layers, so its costs are twice theirs (the bubble rate does not depend on the
  time unit; no communication time).
* Where the half-memory condition ``W + 2B >= 2F`` and ``W + 2F >= 2B`` holds, the paper's V
  building blocks have no bubble in the steady state, so the bubble time does not grow with m
  (as tests/test_v_schedules.py checks for V-Half / V-Min at equal costs). Our greedy search
  does not achieve that with unequal costs yet (docs/schedules.md: behind the ZB fork's
  round-based planner): recorded as a strict xfail with the measured numbers.
"""
from __future__ import annotations

import pytest

from megatron.pipeline.schedules import ScheduleConfig, build_schedule
from megatron.pipeline.simulator import OpCosts, simulate_schedule
from megatron.pipeline.schedules import ScheduleOptions


def _zbv(p: int, m: int, costs: OpCosts):
    return simulate_schedule(build_schedule("zb-v", ScheduleConfig(p, m, num_iterations=1, options=ScheduleOptions(costs=costs))))


def _one_f_one_b(p: int, m: int, chunk: OpCosts):
    stage = OpCosts(t_f=2 * chunk.t_f, t_b=2 * chunk.t_b, t_w=2 * chunk.t_w)
    return simulate_schedule(build_schedule("1f1b", ScheduleConfig(p, m, num_iterations=1)), stage)


@pytest.mark.parametrize("costs", [OpCosts(t_f=1, t_b=2, t_w=1), OpCosts(t_f=1, t_b=1.5, t_w=0.5)],
                         ids=["f1-b2-w1", "f1-b1.5-w0.5"])
@pytest.mark.parametrize("p, k", [(4, 2), (4, 4), (8, 2), (8, 4)])
def test_zbv_bubble_is_at_most_1f1b_at_the_same_memory(costs: OpCosts, p: int, k: int) -> None:
    m = k * p
    zbv, ref = _zbv(p, m, costs), _one_f_one_b(p, m, costs)
    assert max(zbv.peak_memory) / 2 <= max(ref.peak_memory) == p  # whole-stage activations
    assert zbv.bubble_rate <= ref.bubble_rate, (zbv.bubble_rate, ref.bubble_rate)


@pytest.mark.xfail(strict=True, reason="zb-v's greedy leaves a steady-state bubble with unequal costs: "
                   "F=1, B=1.2, W=0.8, p=4: bubble time 2.83 max-op units at m=8, 4.5 at m=16")
def test_zbv_has_no_steady_state_bubble_where_the_half_memory_condition_holds() -> None:
    f, b, w = 1.0, 1.2, 0.8
    assert w + 2 * b >= 2 * f and w + 2 * f >= 2 * b
    costs = OpCosts(t_f=f, t_b=b, t_w=w)
    times = [(r.cost - r.ideal) for r in (_zbv(4, m, costs) for m in (8, 16))]
    assert times[1] <= times[0], times
