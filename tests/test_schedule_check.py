"""The static schedule check: accepts every generated synchronous schedule, rejects
hand-broken ones with a message naming the stage and the op, and the replay reproduces the
textbook in-flight activation counts of 1F1B and GPipe.

Broken schedules are built by editing generated op lists, so each case differs from a
valid schedule by exactly the defect it is meant to exhibit.
"""
from __future__ import annotations

import re

import pytest

from megatron.pipeline.comm import Message, op_sends
from megatron.pipeline.ir import B, BW, F, OPT, Op, OpKind, PipelineLayout, W
from megatron.pipeline.replay import ReplayEngine, ScheduleError
from megatron.pipeline.schedules import ScheduleConfig, build_schedule
from megatron.pipeline.schedule_check import check_schedule, check_streams

SYNC_SCHEDULES = ("1f1b", "gpipe")
ITERATIONS = 2


def generated(name: str, num_stages: int, m: int, iterations: int = ITERATIONS) -> list[list[Op]]:
    """Materialised per-stage op lists of a generated schedule."""
    schedule = build_schedule(name, ScheduleConfig(num_stages, m, num_iterations=iterations))
    return [list(stream) for stream in schedule.streams()]


def reject(streams: list[list[Op]], num_stages: int) -> str:
    """Check, expect a ScheduleError, return its message."""
    with pytest.raises(ScheduleError) as info:
        check_streams(streams, PipelineLayout(num_stages))
    return str(info.value)


def swap(ops: list[Op], a: Op, b: Op) -> None:
    i, j = ops.index(a), ops.index(b)
    ops[i], ops[j] = ops[j], ops[i]


# ------------------------------------------------------------------------------ accepts


@pytest.mark.parametrize("name", SYNC_SCHEDULES)
def test_accepts_every_generated_synchronous_schedule(name: str) -> None:
    checked = 0
    for n in range(1, 9):
        for m in range(1, 3 * n + 1):
            schedule = build_schedule(name, ScheduleConfig(n, m, num_iterations=ITERATIONS))
            counts = check_schedule(schedule)
            # Every stage runs m forwards, m backwards and one step per iteration.
            assert counts == [ITERATIONS * (2 * m + 1)] * n, (name, n, m)
            checked += 1
    assert checked == sum(3 * n for n in range(1, 9))


@pytest.mark.parametrize("name", SYNC_SCHEDULES)
def test_generated_streams_have_the_expected_op_multiset(name: str) -> None:
    """Independent of the replay: each stage forwards and backwards each micro-batch once."""
    n, m = 4, 6
    for s, ops in enumerate(generated(name, n, m)):
        assert sorted(op.microbatch for op in ops if op.kind is OpKind.F) == list(range(ITERATIONS * m))
        assert sorted(op.microbatch for op in ops if op.kind is OpKind.BW) == list(range(ITERATIONS * m))
        assert [op for op in ops if op.kind is OpKind.OPT] == [OPT(s, k, sync=True) for k in range(ITERATIONS)]


# ------------------------------------------------------------------------------ rejects


def test_rejects_deadlock_naming_the_blocked_stages_and_ops() -> None:
    # Stage 0 waits for the gradient of micro-batch 0 before it sends activation 1, while
    # stage 1 waits for activation 1 before it computes that gradient.
    streams = [
        [F(0, 0), BW(0, 0), F(0, 1), BW(0, 1), OPT(0, 0, True)],
        [F(1, 0), F(1, 1), BW(1, 0), BW(1, 1), OPT(1, 0, True)],
    ]
    msg = reject(streams, 2)
    assert "deadlock" in msg
    assert re.search(r"stage 0: blocked at BW0@s0", msg), msg
    assert re.search(r"stage 1: blocked at F1@s1", msg), msg


def test_rejects_deadlock_built_from_a_generated_1f1b() -> None:
    # 1F1B on 3 stages: stage 1 does its first backward only after its second forward;
    # moving BW0 right after F0 on stage 0 (a locally valid order) makes stage 0 wait for a
    # gradient that needs the activation of F1 it has not sent yet.
    streams = generated("1f1b", 3, 4, iterations=1)
    streams[0].remove(BW(0, 0))
    streams[0].insert(1, BW(0, 0))
    assert streams[0][:4] == [F(0, 0), BW(0, 0), F(0, 1), F(0, 2)]
    msg = reject(streams, 3)
    assert "deadlock" in msg and "stage 0: blocked at BW0@s0" in msg, msg


def test_rejects_fifo_violation_between_a_stage_pair() -> None:
    # GPipe, stage 0 sends activation 1 before activation 0; stage 1 expects 0 first.
    streams = generated("gpipe", 2, 3, iterations=1)
    swap(streams[0], F(0, 0), F(0, 1))
    msg = reject(streams, 2)
    assert msg.startswith("stage 1: F0@s1 expects act(mb0)"), msg
    assert "next message from stage 0 is act(mb1)" in msg
    assert "F1@s0" in msg  # the sender of the misordered message


def test_rejects_fifo_violation_of_gradients() -> None:
    # Stage 1 returns gradient 1 before gradient 0; stage 0 runs BW0 first.
    streams = generated("gpipe", 2, 2, iterations=1)
    swap(streams[1], BW(1, 0), BW(1, 1))
    msg = reject(streams, 2)
    assert msg.startswith("stage 0: BW0@s0 expects grad(mb0)"), msg
    assert "grad(mb1)" in msg


def test_rejects_backward_before_its_forward() -> None:
    # Last stage (receives nothing for BW, so the replay does not simply block on it).
    streams = generated("1f1b", 2, 2, iterations=1)
    swap(streams[1], F(1, 0), BW(1, 0))
    msg = reject(streams, 2)
    assert msg == "stage 1: BW0@s1 runs before the forward of its micro-batch", msg


def test_rejects_forward_without_backward() -> None:
    streams = generated("1f1b", 3, 3, iterations=1)
    for s in range(3):
        streams[s].remove(BW(s, 2))  # every stage forgets micro-batch 2's backward
    msg = reject(streams, 3)
    assert msg.startswith("stage 0:") and "micro-batch 2" in msg and "never has a backward" in msg, msg


def test_forward_without_backward_is_fine_for_forward_only() -> None:
    streams = [[F(s, mb) for mb in range(3)] for s in range(3)]
    assert check_streams(streams, PipelineLayout(3), forward_only=True) == [3, 3, 3]
    msg = reject(streams, 3)
    assert "stage 0" in msg and "never has a backward" in msg


def test_rejects_unmatched_send() -> None:
    # Stage 0 forwards an extra micro-batch 99 that stage 1 never receives.
    streams = generated("1f1b", 2, 2, iterations=1)
    streams[0].append(F(0, 99))
    msg = reject(streams, 2)
    assert "sent but never received" in msg, msg
    assert "act(mb99) s0.c0->s1.c0" in msg and "sent by F99@s0" in msg, msg


def test_rejects_split_backward_without_w() -> None:
    # Stage 1 splits micro-batch 0's backward but never computes the weight gradient:
    # caught at the optimizer step that would apply an incomplete gradient...
    streams = generated("1f1b", 2, 2, iterations=1)
    i = streams[1].index(BW(1, 0))
    streams[1][i] = B(1, 0)
    msg = reject(streams, 2)
    assert msg.startswith("stage 1: OPT#0(sync)@s1 steps while the weight gradient of micro-batch 0"), msg

    # ... and at the end of a stream without a step.
    streams = [[op for op in ops if op.kind is not OpKind.OPT] for ops in generated("1f1b", 2, 2, 1)]
    i = streams[1].index(BW(1, 1))
    streams[1][i] = B(1, 1)
    msg = reject(streams, 2)
    assert msg == "stage 1: B1.c0 never gets its W", msg


def test_split_backward_with_w_is_accepted_and_w_without_b_is_not() -> None:
    streams = generated("1f1b", 2, 2, iterations=1)
    i = streams[1].index(BW(1, 0))
    streams[1][i : i + 1] = [B(1, 0), W(1, 0)]
    check_streams(streams, PipelineLayout(2))  # control: the split itself is fine

    streams = generated("1f1b", 2, 2, iterations=1)
    streams[0].insert(streams[0].index(OPT(0, 0, True)), W(0, 1))
    msg = reject(streams, 2)
    assert msg == "stage 0: W1@s0 has no preceding split backward (B) of its micro-batch", msg


def test_rejects_sync_update_index_mismatch_across_stages() -> None:
    streams = generated("1f1b", 3, 2, iterations=2)
    i = streams[2].index(OPT(2, 1, True))
    streams[2][i] = OPT(2, 0, True)  # stage 2 claims its second step is update 0 again
    msg = reject(streams, 3)
    assert "disagree on the synchronous optimizer step" in msg, msg
    assert "OPT#1(sync)@s0" in msg and "OPT#0(sync)@s2" in msg, msg


def test_rejects_update_index_skipping_consistently_on_all_stages() -> None:
    # All stages agree, but all skip from update 0 to update 2.
    streams = generated("gpipe", 2, 2, iterations=2)
    for s in range(2):
        i = streams[s].index(OPT(s, 1, True))
        streams[s][i] = OPT(s, 2, True)
    msg = reject(streams, 2)
    assert msg == "stage 0: OPT#2(sync)@s0 is update 2 but 1 updates were applied before it", msg


def test_rejects_op_in_the_wrong_stream() -> None:
    streams = generated("1f1b", 2, 2, iterations=1)
    streams[1][0] = F(0, 0)
    assert "stream of stage 1 yielded F0@s0" in reject(streams, 2)


# ------------------------------------------------------------------------------ in-flight


def replay_peak_in_flight(streams: list[list[Op]], num_stages: int) -> list[int]:
    """Peak of (forwards - backwards) per stage, counted while the engine replays."""
    layout = PipelineLayout(num_stages)
    live = [0] * num_stages
    peak = [0] * num_stages

    def execute(op: Op, inputs: dict[Message, object]) -> dict[Message, object]:
        if op.kind is OpKind.F:
            live[op.stage] += 1
            peak[op.stage] = max(peak[op.stage], live[op.stage])
        elif op.kind in (OpKind.BW, OpKind.B):
            live[op.stage] -= 1
        return {msg: None for msg in op_sends(op, layout)}

    ReplayEngine(streams, layout, execute, lambda ops: None).run()
    assert live == [0] * num_stages
    return peak


def list_peak_in_flight(ops: list[Op]) -> int:
    live = peak = 0
    for op in ops:
        live += op.kind is OpKind.F
        live -= op.kind is OpKind.BW
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("n", range(1, 9))
def test_1f1b_peak_in_flight_is_min_m_and_n_minus_s(n: int) -> None:
    for m in range(1, 3 * n + 1):
        streams = generated("1f1b", n, m)
        expected = [min(m, n - s) for s in range(n)]
        assert replay_peak_in_flight(streams, n) == expected, (n, m)
        assert [list_peak_in_flight(ops) for ops in streams] == expected, (n, m)


@pytest.mark.parametrize("n", range(1, 9))
def test_gpipe_peak_in_flight_is_m(n: int) -> None:
    for m in range(1, 3 * n + 1):
        streams = generated("gpipe", n, m)
        assert replay_peak_in_flight(streams, n) == [m] * n, (n, m)
        assert [list_peak_in_flight(ops) for ops in streams] == [m] * n, (n, m)
