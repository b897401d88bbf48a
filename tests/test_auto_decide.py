"""``decide(profile, candidates, limits)``: ``auto``'s decision as one pure function (issue #41).

The references are independent of the function: the analytic optima of equal costs (a chain's
1F1B-like optimum ``(N - 1) + 3 m``, a V's ``(N - 1) / 2 + 3 m``: the same formulas as
``tests/test_auto_relayout.py``), the margin rule written out, and the schedule's own decision
(``AutoSchedule.set_costs``), which must be this function's.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from megatron.pipeline.costs.op_costs import OpCosts
from megatron.pipeline.planner.decide import RELAYOUT_MARGIN, Candidates, Limits, decide
from megatron.pipeline.planner.relayout import Relayout
from megatron.pipeline.schedules import ScheduleConfig, ScheduleConfigError, build_schedule

N, M = 4, 8
EQUAL = (OpCosts(1.0, 1.0, 1.0, m_w=1.0),) * N
V = Relayout("zb-v", 2, (1,) * (2 * N))


def test_the_chain_alone_reaches_its_optimum() -> None:
    decision = decide(EQUAL, Candidates(ScheduleConfig(N, M, 1)), Limits())
    assert decision.relayout is None
    assert decision.best.iteration_time == pytest.approx((N - 1) + 3 * M, rel=1e-12)
    assert decision.ranked[0] is decision.best


def test_a_relayout_wins_only_by_the_margin() -> None:
    candidates = Candidates(ScheduleConfig(N, M, 1), relayouts=(V,), stage_layers=(2,) * N)
    won = decide(EQUAL, candidates, Limits())
    assert won.relayout == V and won.best.iteration_time == pytest.approx((N - 1) / 2 + 3 * M, rel=1e-12)
    chain = next(c for c in won.ranked if c.relayout is None)
    # a margin the V's gain does not reach keeps the chain
    gain = chain.iteration_time / won.best.iteration_time - 1
    kept = decide(EQUAL, candidates, Limits(margin=gain + 1e-6))
    assert kept.relayout is None and kept.best == chain
    assert decide(EQUAL, candidates, Limits(margin=gain - 1e-6)).relayout == V
    assert gain > RELAYOUT_MARGIN  # so the default margin lets the V win (as above)


def test_a_checkpoints_choice_is_kept_and_an_impossible_one_refused() -> None:
    candidates = Candidates(ScheduleConfig(N, M, 1), relayouts=(V,), stage_layers=(2,) * N)
    assert decide(EQUAL, candidates, Limits(), chosen="1f1b").best.schedule == "1f1b"
    with pytest.raises(ScheduleConfigError, match="choice nonesuch cannot run here"):
        decide(EQUAL, candidates, Limits(), chosen="nonesuch")
    with pytest.raises(ScheduleConfigError, match="no schedule fits the memory limit 0.5"):
        decide(EQUAL, candidates, Limits(memory=0.5))


def test_auto_schedule_decides_through_it() -> None:
    from megatron.pipeline.planner.auto_schedule import AutoOptions, register_auto_selectors

    register_auto_selectors()  # auto, auto-async
    options = AutoOptions(profile_iters=0, costs=EQUAL, relayouts=(V,), stage_layers=(2,) * N)
    auto = build_schedule("auto", ScheduleConfig(N, M, 5, options=options))
    decision = decide(EQUAL, Candidates(ScheduleConfig(N, M, 1), relayouts=(V,), stage_layers=(2,) * N), Limits())
    assert auto.relayout == decision.relayout == V
    assert [c.label for c in auto.choice["ranked"]] == [c.label for c in decision.ranked]


def test_decide_imports_no_torch() -> None:
    code = "import sys, megatron.pipeline.planner.decide; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("schedule, tied", [("auto", True), ("auto-async", False)])
def test_auto_async_is_untied_as_an_asynchronous_schedule(schedule: str, tied: bool) -> None:
    """``auto-async`` may switch to an asynchronous schedule, so it unties the embeddings as one
    does (its trait, not its class, says so); ``auto`` chooses among synchronous ones and ties."""
    from megatron.trainer.plan.parse import parse_run_plan

    embeddings = parse_run_plan(["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--mock-data",
                                 "--device", "cpu", "--pipeline-schedule", schedule]).embeddings
    assert embeddings.tied is tied
    assert (f"as every asynchronous schedule ({schedule})" in embeddings.line) is not tied
