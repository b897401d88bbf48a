"""The event clock on its own: start = max(stage free, inputs' arrival), comm delay only across
stages, memory peaks, the two bubble forms, waits and collectives."""
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
    assert clock.align([0, 1], [0.5, 0.25]) == (2.0, 2.5)
    assert clock.free == [2.5, 2.5, 0.0] and clock.busy == [2.5, 1.25, 0.0]


def test_comm_has_one_delay_per_stage() -> None:
    with pytest.raises(ValueError, match="2 comm delays for 3 stages"):
        EventClock(3, comm=[0.0, 0.0])
