"""The seam between the one driver and where stages live: the in-process transport's
collectives are the identities the distributed ones reduce to for one process, and the
profiling hook is chosen by what a schedule declares, not by its class."""
from __future__ import annotations

from megatron.pipeline.ir import PipelineLayout
from megatron.pipeline.runtime.transport.in_process import InProcessTransport
from megatron.pipeline.schedules import ScheduleConfig, build_schedule
from megatron.pipeline.costs.op_costs import OpCosts
from megatron.pipeline.schedules import ScheduleOptions
from megatron.pipeline.schedules.zero_bubble.flags import ZeroBubbleOptions

COSTS = [OpCosts(t_f=1.0, t_b=1.0, t_w=1.0, t_comm=0.0)] * 4


def test_in_process_transport_is_every_stage_of_one_replica() -> None:
    transport = InProcessTransport(PipelineLayout(3))
    assert transport.stages == (0, 1, 2) and transport.num_reporters == 3
    assert transport.is_coordinator and transport.dp_rank == 0 and transport.data_parallel_size == 1
    assert transport.all_sum([1.5, 2.0]) == [1.5, 2.0] and transport.all_max([3.0]) == [3.0]
    assert transport.gather_rows({2: [7], 0: [5]}) == [(0, [5.0]), (2, [7.0])]  # stage order


def test_profiling_is_a_capability_the_schedule_declares() -> None:
    plain = build_schedule("1f1b", ScheduleConfig(4, 8, 2))
    assert not plain.policy.profiles_ops() and plain.policy.fixed_costs is None
    profiled = build_schedule("zb-1p", ScheduleConfig(4, 8, 2, options=ZeroBubbleOptions(profile_iters=1)))
    assert profiled.policy.profiles_ops() and profiled.policy.fixed_costs is None
    profiled.set_costs(COSTS)
    assert not profiled.policy.profiles_ops()  # decided: later segments run the chosen order untimed
    fixed = build_schedule("zb-1p", ScheduleConfig(4, 8, 2, options=ScheduleOptions(costs=COSTS)))
    assert not fixed.policy.profiles_ops() and fixed.policy.fixed_costs == tuple(COSTS)
