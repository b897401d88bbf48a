"""The event clock on its own. Dedicated cores: start = max(stage free, inputs' arrival), comm
delay only across stages, memory peaks, the two bubble forms, waits and collectives. Shared
cores: runnable stages progress at min(1, cores / runnable), ends resolved event by event
(hand-computed; the schedules' makespans are in the fixture test)."""
from __future__ import annotations

import math

import pytest

from megatron.pipeline.event_clock import EventClock


def test_an_op_starts_when_its_stage_is_free_and_its_input_has_arrived() -> None:
    clock = EventClock(2, comm=[0.5, 0.25])
    assert clock.place(0, 1.0, key="F0") == 0.0
    assert clock.arrival("F0", 0, 1) == 1.5 and clock.arrival("F0", 0, 0) == 1.0  # no delay on its own stage
    assert clock.arrival("F1", 0, 1) == math.inf  # not placed yet
    assert clock.place(1, 2.0, clock.arrival("F0", 0, 1), key="F0'") == 1.5
    assert clock.free == [1.0, 3.5] and clock.makespan() == 3.5
    assert clock.start_time(0, 0.25) == 1.0 and clock.start_time(0, 2.0) == 2.0


def test_memory_peak_and_busy_follow_each_op() -> None:
    clock = EventClock(1)
    for delta in (1.0, 1.0, -0.5, -1.0):
        clock.place(0, 1.0, memory_delta=delta)
    assert clock.memory == [0.5] and clock.peak_memory == [2.0] and clock.busy == [4.0]


def test_bubble_counts_idle_time_after_the_first_op_only() -> None:
    clock = EventClock(2)
    clock.place(0, 1.0, ready=3.0)  # waits before its first op: not a bubble
    assert clock.bubble == [0.0, 0.0]
    clock.place(0, 1.0, ready=6.0)  # idles 2 after its first op
    clock.wait(1, 2.0)  # not started: no bubble either
    clock.place(1, 1.0)
    clock.wait(1, 4.5)  # idles 1.5 on purpose
    assert clock.bubble == [2.0, 1.5] and clock.max_bubble == 2.0 and clock.free == [7.0, 4.5]


def test_a_collective_aligns_its_stages() -> None:
    clock = EventClock(3)
    clock.place(0, 2.0)
    clock.place(1, 1.0)
    assert clock.align([0, 1], [0.5, 0.25]) == 2.0
    assert clock.free == [2.5, 2.5, 0.0] and clock.busy == [2.5, 1.25, 0.0]


def test_comm_has_one_delay_per_stage() -> None:
    with pytest.raises(ValueError, match="2 comm delays for 3 stages"):
        EventClock(3, comm=[0.0, 0.0])


# -- shared cores ------------------------------------------------------------------------


def test_two_stages_on_one_core_share_it_evenly() -> None:
    """Work 1 each from t = 0 on one core: both run at rate 1/2 and end at 2."""
    clock = EventClock(2, cores=1)
    assert clock.place(0, 1.0, key="a") == 0.0 and clock.place(1, 1.0, key="b") == 0.0
    assert not clock.idle(0) and clock.free == [0.0, 0.0]  # the ends are not known yet
    assert clock.advance() == [0, 1]
    assert clock.now == 2.0 and clock.ends == {"a": 2.0, "b": 2.0} and clock.free == [2.0, 2.0]
    assert clock.idle(0) and clock.idle(1) and clock.busy == [1.0, 1.0] and clock.makespan() == 2.0


def test_three_ops_on_two_cores_end_at_one_and_a_half() -> None:
    clock = EventClock(3, cores=2)
    for s in range(3):
        clock.place(s, 1.0, key=s)
    assert clock.advance() == [0, 1, 2]
    assert clock.ends == {s: pytest.approx(1.5, abs=1e-12) for s in range(3)}


def test_an_op_that_arrives_later_slows_the_other_until_it_ends() -> None:
    """One core. Stage 0: work 2 from 0. Stage 1: work 0.5, input there at 1. Alone until 1
    (1 left), shared at 1/2 until stage 1's op ends at 2 (0.5 left), alone again: ends at 2.5.
    Stage 0's next op waits for its input until 3: a bubble of 0.5."""
    clock = EventClock(2, cores=1.0)
    clock.place(0, 2.0, memory_delta=1.0, key="long")
    assert clock.place(1, 0.5, ready=1.0, key="late") == 1.0
    assert clock.advance() == [] and clock.now == 1.0  # the arrival
    assert clock.advance() == [1] and clock.ends == {"late": 2.0}
    assert clock.advance() == [0] and clock.ends["long"] == 2.5
    assert clock.place(0, 1.0, ready=3.0, memory_delta=-1.0) == 3.0
    assert clock.advance() == [] and clock.advance() == [0]
    assert clock.free == [4.0, 2.0] and clock.busy == [3.0, 0.5]
    assert clock.bubble == [0.5, 0.0] and clock.peak_memory == [1.0, 0.0] and clock.memory == [0.0, 0.0]


def test_a_collective_on_shared_cores_leaves_when_its_last_part_ends() -> None:
    """Parts 0.5 and 0.25 on one core: both at 1/2 until the short one ends at 0.5 (its stage is
    held), the long one alone until 0.75; both stages leave then."""
    clock = EventClock(2, cores=1)
    assert clock.align([0, 1], [0.5, 0.25]) == 0.0
    assert clock.advance() == [] and clock.now == 0.5 and not clock.idle(1)
    assert clock.advance() == [0, 1] and clock.free == [0.75, 0.75] and clock.busy == [0.5, 0.25]


def test_enough_cores_is_the_dedicated_model() -> None:
    shared, dedicated = EventClock(2, cores=2), EventClock(2)
    for clock in (shared, dedicated):
        clock.place(0, 1.0, key="F")
    shared.advance()
    for clock in (shared, dedicated):
        clock.place(1, 2.0, clock.arrival("F", 0, 1), key="F'")
    shared.advance()
    assert shared.ends == dedicated.ends == {"F": 1.0, "F'": 3.0} and shared.free == dedicated.free


def test_each_model_refuses_the_other_models_calls() -> None:
    with pytest.raises(ValueError, match="positive"):
        EventClock(2, cores=0)
    shared = EventClock(2, cores=1)
    with pytest.raises(RuntimeError, match="nothing in flight"):
        shared.advance()
    shared.place(0, 1.0)
    with pytest.raises(ValueError, match="in flight"):
        shared.place(0, 1.0)
    with pytest.raises(ValueError, match="dedicated"):
        shared.wait(1, 1.0)
    with pytest.raises(ValueError, match="shared"):
        EventClock(2).advance()
