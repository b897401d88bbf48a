"""Zero Bubble schedules (ZB-H1, ZB-H2, ZB-1p, ZB-2p): validity, op shape, the paper's memory
formulas and limits, Table 2 and Appendix H closed forms, and the greedy heuristic's
options and consistency with the simulator.
"""
from __future__ import annotations

import pytest

from megatron.pipeline.ir import OpKind
from megatron.pipeline.schedules import SCHEDULES, ScheduleConfig, ScheduleConfigError, build_schedule
from megatron.pipeline.schedules.zero_bubble.greedy import best_greedy_order
from megatron.pipeline.costs.op_costs import OpCosts
from megatron.pipeline.simulator import simulate_schedule
from megatron.pipeline.schedule_check import check_schedule
from megatron.pipeline.schedules import ScheduleOptions
from tests.schedule_options import options_for

ZB_SCHEDULES = ("zb-h1", "zb-h2", "zb-1p", "zb-2p")


def build(name: str, n: int, m: int, costs: OpCosts | None = None, iterations: int = 1, **options):
    return build_schedule(name, ScheduleConfig(n, m, num_iterations=iterations, options=options_for(name, costs=costs, **options)))


def test_registered() -> None:
    assert set(ZB_SCHEDULES) <= set(SCHEDULES)


@pytest.mark.parametrize("name", ZB_SCHEDULES)
def test_schedule_check_accepts_every_generated_schedule(name: str) -> None:
    checked = 0
    for n in range(2, 9):
        for m in range(n, 4 * n + 1):
            counts = check_schedule(build(name, n, m))
            assert counts == [3 * m + 1] * n, (name, n, m)  # m F, m B, m W, one step
            checked += 1
    assert checked == sum(3 * n + 1 for n in range(2, 9))


@pytest.mark.parametrize("name", ZB_SCHEDULES)
def test_split_backward_ops_and_synchronous_steps(name: str) -> None:
    n, m, iterations = 4, 7, 3
    schedule = build(name, n, m, OpCosts(1.0, 1.2, 0.6, t_comm=0.1), iterations=iterations)
    assert check_schedule(schedule) == [iterations * (3 * m + 1)] * n
    for stage, stream in enumerate(schedule.streams()):
        ops = list(stream)
        assert OpKind.BW not in {op.kind for op in ops}
        steps = [i for i, op in enumerate(ops) if op.kind is OpKind.OPT]
        assert steps == [(3 * m + 1) * (k + 1) - 1 for k in range(iterations)]
        assert all(ops[i].sync and ops[i].update == k for k, i in enumerate(steps))
        for k in range(iterations):  # each iteration covers its own global micro-batches
            body = ops[(3 * m + 1) * k : (3 * m + 1) * (k + 1) - 1]
            assert sorted(op.microbatch for op in body) == sorted(list(range(k * m, (k + 1) * m)) * 3)


# ------------------------------------------------------------------ memory

M_W = 0.5  # the default M_W / M_B


def test_handcrafted_memory_formulas() -> None:
    """§2.2 / §2.3: (N - s) M_B + s M_W for ZB-H1, (2N - 2s - 1) M_B + 2s M_W for ZB-H2."""
    for n in range(2, 9):
        for m in (2 * n, 3 * n):
            one = simulate_schedule(build("1f1b", n, m)).peak_memory
            h1 = simulate_schedule(build("zb-h1", n, m)).peak_memory
            assert h1 == pytest.approx([(n - s) + s * M_W for s in range(n)])
            assert max(h1) == max(one) == n  # the peak of 1F1B, on the first stage
            assert all(x <= n for x in h1)
            # Only counting whole micro-batches (M_W = 0), ZB-H1 holds what 1F1B holds, per stage.
            h1_b = simulate_schedule(build("zb-h1", n, m, OpCosts(m_w=0.0))).peak_memory
            assert h1_b == one
            h2 = simulate_schedule(build("zb-h2", n, m)).peak_memory
            assert h2 == pytest.approx([(2 * n - 2 * s - 1) + 2 * s * M_W for s in range(n)])
            assert max(h2) == 2 * n - 1


def test_greedy_schedules_respect_their_memory_limit() -> None:
    cases = [OpCosts(), OpCosts(1.0, 1.1, 0.5, t_comm=0.05), OpCosts(1.0, 0.9, 0.8, t_comm=0.2, m_w=0.4)]
    for costs in cases:
        for n in range(2, 9):
            for m in (n, 2 * n, 4 * n):
                for name, limit in (("zb-1p", n), ("zb-2p", 2 * n)):
                    schedule = build(name, n, m, costs)
                    assert schedule.memory_limit == limit
                    peak = simulate_schedule(schedule).peak_memory
                    assert max(peak) <= limit + 1e-9, (name, n, m, costs, peak)


def test_unequal_stage_costs() -> None:
    """Per-stage costs (a later stage whose warm-up estimate exceeds its predecessor's used to
    let it run a forward before its input existed): valid, within the limit, and consistent."""
    import random

    rng = random.Random(7)
    for _ in range(40):
        n = rng.randint(2, 7)
        m = rng.randint(1, 3 * n)
        costs = [
            OpCosts(rng.uniform(0.2, 3), rng.uniform(0.2, 3), rng.uniform(0.0, 3),
                    t_comm=rng.choice([0.0, rng.uniform(0, 1)]), m_w=rng.choice([0.0, 0.3, 0.5, 1.0]))
            for _ in range(n)
        ]
        for name in ("zb-1p", "zb-2p"):
            schedule = build(name, n, m, costs, iterations=2)
            check_schedule(schedule)
            result = simulate_schedule(schedule)
            assert max(result.peak_memory) <= schedule.memory_limit + 1e-9
    # The case that exposed it.
    costs = [OpCosts(1.71, 2.61, 0.70, t_comm=0.51, m_w=1.0), OpCosts(2.75, 2.05, 1.83, t_comm=0.73, m_w=0.3),
             OpCosts(1.65, 1.77, 1.28, t_comm=0.06, m_w=0.3), OpCosts(2.83, 1.36, 2.44, m_w=0.0),
             OpCosts(1.48, 0.28, 0.69), OpCosts(2.44, 2.43, 2.45), OpCosts(2.63, 1.47, 2.26, t_comm=0.28)]
    check_schedule(build("zb-2p", 7, 7, costs))


def test_custom_memory_limit_and_infeasible_limits() -> None:
    n, m = 4, 16
    costs = OpCosts(1.0, 1.0, 0.5, t_comm=0.05)
    rates = []
    for limit in (2.0, 3.0, 4.0, 6.0, 8.0):
        schedule = build("zb-1p", n, m, costs, memory_limit=limit)
        result = simulate_schedule(schedule)
        assert max(result.peak_memory) <= limit + 1e-9
        rates.append(result.bubble_rate)
    assert rates == sorted(rates, reverse=True) and rates[-1] < rates[0]
    with pytest.raises(ScheduleConfigError, match="memory limit of 0.5 M_B"):
        build("zb-2p", n, m, memory_limit=0.5)
    with pytest.raises(ScheduleConfigError, match="bad costs option"):
        build("zb-2p", n, m, costs=[OpCosts()])


# ------------------------------------------------------------------ closed forms


@pytest.mark.parametrize("t_f,t_b,t_w", [(1.0, 1.0, 1.0), (1.0, 1.2, 0.5), (2.0, 1.5, 1.0), (1.0, 1.0, 0.3)])
def test_table2_bubbles_of_handcrafted_schedules(t_f: float, t_b: float, t_w: float) -> None:
    """Table 2 at T_comm = 0, T_W <= min(T_F, T_B), m >= 2p: bubble of the busiest span."""
    costs = OpCosts(t_f, t_b, t_w)
    for n in range(2, 7):
        for m in (2 * n, 3 * n):
            ideal = m * (t_f + t_b + t_w)
            h1 = simulate_schedule(build("zb-h1", n, m, costs))
            h2 = simulate_schedule(build("zb-h2", n, m, costs))
            assert h1.cost - ideal == pytest.approx((n - 1) * (t_f + t_b - t_w))
            assert h2.cost - ideal == pytest.approx((n - 1) * (t_f + t_b - 2 * t_w))


def test_table2_conditions_over_random_configs() -> None:
    """What docs/schedules.md states: Table 2's bubbles are exact when T_W <= min(T_F, T_B)
    (T_comm = 0; m >= N for ZB-H1, m >= 2N - 1 for ZB-H2), so ZB-H2's bubble is 0 only at
    T_F = T_B = T_W; the weaker T_F + T_B <= 2 T_W does not make it 0 (it allows
    T_W > min(T_F, T_B), where Table 2 breaks)."""
    import random

    rng = random.Random(0)
    covered = bubbly_under_weak_condition = 0
    for _ in range(150):
        n = rng.randint(2, 6)
        m = rng.randint(n, 3 * n)
        t_f, t_b, t_w = (round(rng.uniform(0.2, 2.0), 3) for _ in range(3))
        costs, ideal = OpCosts(t_f, t_b, t_w), m * (t_f + t_b + t_w)
        h2 = simulate_schedule(build("zb-h2", n, m, costs)).cost - ideal if m >= 2 * n - 1 else None
        if t_w <= min(t_f, t_b):
            covered += 1
            h1 = simulate_schedule(build("zb-h1", n, m, costs)).cost - ideal
            assert h1 == pytest.approx((n - 1) * (t_f + t_b - t_w)), (n, m, t_f, t_b, t_w)
            if h2 is not None:
                assert h2 == pytest.approx((n - 1) * (t_f + t_b - 2 * t_w)), (n, m, t_f, t_b, t_w)
        if t_f + t_b <= 2 * t_w and h2 is not None and h2 > 1e-9:
            bubbly_under_weak_condition += 1
    assert covered > 30 and bubbly_under_weak_condition > 10
    for n in range(2, 7):  # the paper's Section 2 setting: zero bubble
        m = 2 * n - 1
        assert simulate_schedule(build("zb-h2", n, m, OpCosts(1.0, 1.0, 1.0))).cost == pytest.approx(3.0 * m)


@pytest.mark.parametrize("name", ["zb-h1", "zb-1p", "zb-2p"])
def test_appendix_h_few_microbatches(name: str) -> None:
    """m <= p, no communication: a ZB iteration takes (m + p - 1)(T_F + T_B) + T_W."""
    for t_f, t_b, t_w in [(1.0, 1.0, 1.0), (1.0, 1.2, 0.5), (2.0, 1.5, 1.0)]:
        for n in (4, 8):
            for m in (2, 4, n):
                r = simulate_schedule(build(name, n, m, OpCosts(t_f, t_b, t_w)))
                assert r.makespan == pytest.approx((m + n - 1) * (t_f + t_b) + t_w)


# ------------------------------------------------------------------ the heuristic

PAPER_1_5B = OpCosts(18.522, 18.086, 9.337, t_comm=0.601)  # Table 6, 1.5B, m = 24


def test_zb_1p_finds_zb_h1_in_the_paper_setting() -> None:
    """Spec §4.3: at M_limit = p M_B the heuristic finds ZB-H1 for 1.5B, m = 24: the same F/B
    order on every stage and the same cost; W passes may move into idle gaps of later stages."""
    zb_1p, zb_h1 = build("zb-1p", 8, 24, PAPER_1_5B), build("zb-h1", 8, 24, PAPER_1_5B)
    for auto, hand in zip(zb_1p.streams(), zb_h1.streams()):
        auto, hand = list(auto), list(hand)
        assert [op for op in auto if op.kind is not OpKind.W] == [op for op in hand if op.kind is not OpKind.W]
    assert list(zb_1p.stage_ops(0)) == list(zb_h1.stage_ops(0))
    assert simulate_schedule(zb_1p).cost == pytest.approx(simulate_schedule(zb_h1).cost)


def test_zb_2p_warmup_matches_appendix_b() -> None:
    """Stage 0 runs floor(((p-1)(T_B + 2 T_comm) + p T_F) / T_F) = 15 forwards before its first B."""
    stream = list(build("zb-2p", 8, 24, PAPER_1_5B).streams()[0])
    first_b = next(i for i, op in enumerate(stream) if op.kind is OpKind.B)
    assert first_b == 15 and all(op.kind is OpKind.F for op in stream[:first_b])


def test_greedy_cost_is_the_simulated_cost() -> None:
    for costs in (PAPER_1_5B, OpCosts(1.0, 1.3, 0.4, t_comm=0.2)):
        for n, m in ((4, 9), (8, 24)):
            for name in ("zb-1p", "zb-2p"):
                schedule = build(name, n, m, costs)
                result = simulate_schedule(schedule)
                assert result.cost == pytest.approx(schedule.plan.cost)
                assert result.makespan == pytest.approx(schedule.plan.makespan)


def test_grid_search_is_cached_and_costs_come_from_options() -> None:
    costs = OpCosts(1.0, 1.1, 0.7, t_comm=0.1)
    a = build("zb-2p", 6, 18, costs, iterations=2)
    b = build("zb-2p", 6, 18, OpCosts(1.0, 1.1, 0.7, t_comm=0.1))  # equal costs, other object
    assert a.plan is b.plan
    as_dict = build("zb-2p", 6, 18, None, iterations=1)
    assert as_dict.plan.cost == best_greedy_order((OpCosts(),) * 6, 18, 12.0).cost
    from_profile = build_schedule(
        "zb-2p", ScheduleConfig(6, 18, options=ScheduleOptions(costs={"t_f": 1.0, "t_b": 1.1, "t_w": 0.7, "t_comm": 0.1}))
    )
    assert from_profile.plan is a.plan
    # Default costs without the option: the placeholder T_F = T_B = T_W = 1, T_comm = 0.
    default = build_schedule("zb-2p", ScheduleConfig(6, 18))
    assert default.costs == (OpCosts(),) * 6
