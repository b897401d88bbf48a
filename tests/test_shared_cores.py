"""The planner's processor-sharing replay (stages outnumbering a host's cores) against the
simulator and hand-computed makespans."""
from __future__ import annotations

import pytest

from megatron.pipeline.planner.shared_cores import shared_core_makespan
from megatron.pipeline.schedules import build_schedule
from megatron.pipeline.schedules.base import ScheduleConfig
from megatron.pipeline.costs.op_costs import OpCosts
from megatron.pipeline.simulator import simulate_schedule
from megatron.pipeline.schedules import ScheduleOptions

COSTS = OpCosts(t_f=1.0, t_b=2.0, t_w=1.0, t_comm=0.25)


def _schedule(name: str, n: int, m: int, iterations: int = 1, chunks: int = 1):
    return build_schedule(name, ScheduleConfig(num_stages=n, num_microbatches=m, num_iterations=iterations,
                                               num_chunks=chunks, options=ScheduleOptions(costs=COSTS)))


def _shared(name: str, n: int, m: int, cores: float, **kw) -> float:
    s = _schedule(name, n, m, **kw)
    return shared_core_makespan(s.streams(), s.layout, COSTS, cores)


@pytest.mark.parametrize("name,n,m,kw", [("1f1b", 4, 8, {}), ("gpipe", 2, 4, {}), ("zb-h1", 4, 4, {}),
                                         ("interleaved-1f1b", 2, 4, {"chunks": 2}), ("paci", 4, 4, {"iterations": 3}),
                                         ("dualpipev", 2, 4, {}), ("1f1b", 2, 4, {"iterations": 2})])
def test_enough_cores_is_the_simulator(name: str, n: int, m: int, kw: dict) -> None:
    """With a core per stage nobody is slowed: exactly the simulator's makespan."""
    expected = simulate_schedule(_schedule(name, n, m, **kw)).makespan
    assert _shared(name, n, m, cores=n, **kw) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name,n,m", [("1f1b", 4, 8), ("zb-h1", 2, 4), ("gpipe", 3, 2), ("zb-2p", 4, 8)])
def test_one_core_without_latency_runs_all_the_work_back_to_back(name: str, n: int, m: int) -> None:
    """With t_comm = 0 one core never idles (the replay engine guarantees some op can run, and
    its inputs have arrived the moment they were sent): the makespan is all the work,
    n*m*(F+B+W) for these schedules (every micro-batch's F, B and W on every stage)."""
    costs = OpCosts(t_f=1.0, t_b=2.0, t_w=1.0)
    s = build_schedule(name, ScheduleConfig(num_stages=n, num_microbatches=m))
    assert shared_core_makespan(s.streams(), s.layout, costs, 1) == pytest.approx(n * m * 4.0, rel=1e-12)


def test_two_stages_on_one_core_by_hand() -> None:
    """ZB-H1, 2 stages, m = 1, t_comm 0.25, one core. Stage 0: F0 [0, 1]. The message arrives at
    1.25: the core idles 0.25. Stage 1: F0 [1.25, 2.25], then B0 (2) to 4.25, the gradient arrives
    at 4.5; stage 1's W0 runs alone from 4.25: from 4.5 both are runnable at half speed; stage 1's W has 0.75
    left at 4.5, ends at 6.0; stage 0's B has 2 - 0.75 = 1.25 left at 6.0 alone: ends at 7.25; W
    to 8.25. The simulator (a core per stage) ends at 1 + .25 + 1 + 2 + .25 + 2 + 1 = 7.5."""
    got = _shared("zb-h1", 2, 1, cores=1)
    assert got == pytest.approx(8.25, abs=1e-9)
    assert simulate_schedule(_schedule("zb-h1", 2, 1)).makespan == pytest.approx(7.5)


def test_more_cores_never_slower_and_fractional_cores() -> None:
    times = [_shared("1f1b", 4, 8, cores=c) for c in (1, 1.5, 2, 3, 4)]
    assert times == sorted(times, reverse=True)
    assert times[0] > times[-1]


def test_synchronous_step_waits_for_every_stage() -> None:
    """Two iterations of 1F1B on 2 cores with a step cost: the second iteration cannot start before
    both stages ran their part of the collective, so the makespan is two one-iteration makespans
    plus the step, per iteration."""
    costs = OpCosts(t_f=1.0, t_b=1.0, t_w=1.0, t_opt=0.5)
    one = build_schedule("1f1b", ScheduleConfig(num_stages=2, num_microbatches=2, num_iterations=1))
    two = build_schedule("1f1b", ScheduleConfig(num_stages=2, num_microbatches=2, num_iterations=2))
    t1 = shared_core_makespan(one.streams(), one.layout, costs, 2)
    t2 = shared_core_makespan(two.streams(), two.layout, costs, 2)
    assert t2 == pytest.approx(2 * t1, abs=1e-9)
    assert t1 == pytest.approx(simulate_schedule(one, costs).makespan, abs=1e-9)


def test_cores_must_be_positive() -> None:
    s = _schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="positive"):
        shared_core_makespan(s.streams(), s.layout, COSTS, 0)
