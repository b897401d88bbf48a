"""Profiled automatic Zero Bubble scheduling: the lazy schedule, cost aggregation, the op
profiler, and the ``--zb-*`` flags (one-line errors before any process starts)."""
from __future__ import annotations

import json

import pytest
import torch

from megatron.pipeline.comm import op_sends
from megatron.pipeline.ir import B, F, W, Op, OpKind
from megatron.pipeline.runtime.memory import ActivationMeter
from megatron.pipeline.runtime.profiling import SUMMARY_FIELDS, OpProfiler, costs_from_summaries
from megatron.pipeline.replay import ReplayEngine
from megatron.pipeline.schedules import ScheduleConfig, ScheduleConfigError, build_schedule
from megatron.pipeline.schedules.zero_bubble.profiled import CostsNotProfiled, ProfiledSchedule
from megatron.pipeline.schedules.zero_bubble.zb_h1 import ZBH1
from megatron.pipeline.costs.op_costs import OpCosts
from megatron.pipeline.simulator import simulate_schedule
from megatron.pipeline.schedule_check import check_schedule
from megatron.pipeline.schedules import ScheduleOptions
from megatron.pipeline.schedules.zero_bubble.flags import ZeroBubbleOptions
from megatron.pipeline.schedules.zero_bubble.post_validation_flags import PostValidationOptions
from tests.schedule_options import options_for

COSTS = (OpCosts(1.0, 1.3, 0.4, t_comm=0.2, m_w=0.6), OpCosts(1.1, 1.2, 0.5, t_comm=0.2, m_w=0.6),
         OpCosts(0.9, 1.0, 0.6, t_comm=0.2, m_w=0.7), OpCosts(1.4, 1.1, 0.3, t_comm=0.2, m_w=0.5))


def profiled(name: str = "zb-2p", n: int = 4, m: int = 8, iterations: int = 4, k: int = 2, **options):
    return build_schedule(name, ScheduleConfig(n, m, iterations, options=options_for(name, profile_iters=k, **options)))


def iterations_of(ops: list[Op]) -> list[list[Op]]:
    out, cur = [], []
    for op in ops:
        if op.kind is OpKind.OPT:
            out.append(cur)
            cur = []
        else:
            cur.append(op)
    return out


# ------------------------------------------------------------------ the lazy schedule


def test_profiled_schedule_runs_zb_h1_then_the_target_from_set_costs() -> None:
    schedule = profiled()
    assert isinstance(schedule, ProfiledSchedule) and schedule.name == "zb-2p" and not schedule.decided
    h1 = build_schedule("zb-h1", ScheduleConfig(4, 8, 4))
    streams = schedule.streams()
    heads = []
    for stream in streams:
        ops = []
        for op in stream:  # stop at the step ending iteration K - 1 = 1, as the executors do
            ops.append(op)
            if op.kind is OpKind.OPT and op.update == 1:
                break
        heads.append(ops)
    for stage, ops in enumerate(heads):
        assert ops == list(h1.stage_ops(stage))[: len(ops)]
    with pytest.raises(CostsNotProfiled, match="iteration 2"):
        next(streams[0])
    schedule.set_costs(COSTS)
    assert schedule.decided and schedule.costs == COSTS
    target = build_schedule("zb-2p", ScheduleConfig(4, 8, 4, options=ScheduleOptions(costs=COSTS)))
    for stage in range(4):
        ours = iterations_of(list(schedule.stage_ops(stage)))
        theirs = iterations_of(list(target.stage_ops(stage)))
        ref_h1 = iterations_of(list(h1.stage_ops(stage)))
        assert ours[:2] == ref_h1[:2] and ours[2:] == theirs[2:]
    assert schedule.target.plan is target.plan  # the same (cached) greedy order
    check_schedule(schedule)
    with pytest.raises(RuntimeError, match="already set"):
        schedule.set_costs(COSTS)


def test_fingerprint_and_description_are_deterministic() -> None:
    a, b = profiled(), profiled()
    a.set_costs(COSTS)
    b.set_costs(tuple(OpCosts(**{f: getattr(c, f) for f in ("t_f", "t_b", "t_w", "t_comm", "m_w")}) for c in COSTS))
    assert a.fingerprint() == b.fingerprint()
    d = a.describe()
    assert d["schedule"] == "zb-2p" and d["memory_limit"] == 8.0 and d["profile_iters"] == 2
    assert d["chosen"]["bubble_rate"] <= d["zb-h1"]["bubble_rate"] + 1e-12
    assert max(d["chosen"]["peak_memory"]) <= 8.0 + 1e-9
    json.dumps(d)  # loggable
    c = profiled("zb-1p")
    c.set_costs(COSTS)
    assert c.describe()["memory_limit"] == 4.0


def test_replay_decides_at_the_barrier() -> None:
    """The replay engine pulls no op past a synchronous step before the collective ran, so a
    hook inside the collective can decide the order of later iterations (as the emulator's)."""
    schedule = profiled(iterations=3, k=1)
    layout = schedule.layout
    seen: list[int] = []

    def execute(op, inputs):
        return {msg: None for msg in op_sends(op, layout)}

    def execute_sync(ops):
        seen.append(ops[0].update)
        if ops[0].update == 0:
            assert not schedule.decided
            schedule.set_costs(COSTS)

    ReplayEngine(schedule.streams(), layout, execute, execute_sync).run()
    assert seen == [0, 1, 2]
    # Without a decision at the barrier the stream refuses to go on.
    late = profiled(iterations=3, k=1)
    with pytest.raises(CostsNotProfiled):
        ReplayEngine(late.streams(), layout, execute, lambda ops: None).run()


def test_small_memory_limit_profiles_within_the_limit() -> None:
    """Below ZB-H1's N M_B the profiling iterations run the target's placeholder order, which
    keeps the limit whatever the real M_W / M_B (planned with M_W = M_B)."""
    schedule = profiled("zb-1p", n=4, m=8, iterations=2, k=1, memory_limit=2.5)
    assert schedule.memory_limit == 2.5 and not isinstance(schedule.warmup, ZBH1)
    schedule.set_costs(COSTS)
    for m_w in (0.0, 0.5, 1.0):
        peak = simulate_schedule(schedule, [OpCosts(m_w=m_w)] * 4).peak_memory
        assert max(peak) <= 2.5 + 1e-9, (m_w, peak)
    assert isinstance(profiled("zb-1p").warmup, ZBH1)  # N M_B: ZB-H1 fits


def test_profiling_applies_to_zb_1p_zb_2p_and_zb_v_only() -> None:
    with pytest.raises(ScheduleConfigError, match="zb-1p, zb-2p and zb-v only"):
        build_schedule("zb-h1", ScheduleConfig(4, 8, 2, options=ZeroBubbleOptions(profile_iters=1)))
    with pytest.raises(ScheduleConfigError, match="memory limit"):
        profiled(memory_limit=0.5)


# ------------------------------------------------------------------ measurements


def _summary(t_f, t_b, t_w, m_w, t_comm, n=8):
    return [t_f, t_b, t_w, m_w, t_comm, n, n, n]


def test_costs_from_summaries() -> None:
    assert len(SUMMARY_FIELDS) == len(_summary(0, 0, 0, 0, 0))
    rows = [  # seconds; two data-parallel replicas of two stages
        _summary(0.0010004, 0.0012, 0.0005, 0.6, 0.00010),
        _summary(0.0011, 0.0011, 0.0006, 0.6, 0.00030),
        _summary(0.0020, 0.0020, 0.0010, 0.8, 0.0),
        _summary(0.0019, 0.0021, 0.0009, 0.8, 0.0),
    ]
    costs = costs_from_summaries(rows, [0, 0, 1, 1], 2)
    assert costs == (OpCosts(1.1, 1.2, 0.6, t_comm=0.3, m_w=0.6), OpCosts(2.0, 2.1, 1.0, t_comm=0.3, m_w=0.8))
    # Order of the gathered rows does not matter.
    assert costs_from_summaries(rows[::-1], [1, 1, 0, 0], 2) == costs
    with pytest.raises(RuntimeError, match="stage 1"):
        costs_from_summaries(rows[:2], [0, 0], 2)


def test_op_profiler_times_ops_and_measures_m_w() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    meter = ActivationMeter([param])
    profiler = OpProfiler(torch.device("cpu"))
    key = (0, 0)
    with profiler.timed(F(0, 0), meter), meter.record(key):
        x = torch.ones(10, requires_grad=True)
        (x * 2).sin().sum()  # saves 10 floats (the sin input)
    with profiler.timed(B(0, 0), meter):
        meter.retain_only(key, [torch.zeros(4)])
    with profiler.timed(W(0, 0), meter):
        meter.release(key)
    with profiler.timed(Op(OpKind.OPT, 0, update=0, sync=True), meter):
        pass  # not timed
    summary = dict(zip(SUMMARY_FIELDS, profiler.summary()))
    assert summary["n_f"] == summary["n_b"] == summary["n_w"] == 1
    assert summary["m_w"] == pytest.approx(16 / 40)
    assert all(summary[k] >= 0 for k in ("t_f", "t_b", "t_w"))


# ------------------------------------------------------------------ flags


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


BASE = ["--pipeline-model-parallel-size", "4", "--num-layers", "4", "--global-batch-size", "8"]
BAD = {
    "costs-with-1f1b": (["--pipeline-schedule", "1f1b", "--zb-costs", "1,1,1,0"], "--zb-costs"),
    "profile-with-zb-h1": (["--pipeline-schedule", "zb-h1", "--zb-profile-iters", "2"], "--zb-profile-iters"),
    "limit-with-gpipe": (["--pipeline-schedule", "gpipe", "--zb-memory-limit", "8"], "--zb-memory-limit"),
    "costs-and-profiling": (["--pipeline-schedule", "zb-2p", "--zb-costs", "1,1,1,0", "--zb-profile-iters", "2"],
                            "--zb-costs"),
    "negative-profile-iters": (["--pipeline-schedule", "zb-2p", "--zb-profile-iters", "-1"], "--zb-profile-iters"),
    "three-costs": (["--pipeline-schedule", "zb-1p", "--zb-costs", "1,1,1"], "--zb-costs"),
    "not-numbers": (["--pipeline-schedule", "zb-1p", "--zb-costs", "1,b,1,0"], "--zb-costs"),
    "negative-cost": (["--pipeline-schedule", "zb-1p", "--zb-costs", "1,-1,1,0"], "--zb-costs"),
    "m-w-above-1": (["--pipeline-schedule", "zb-1p", "--zb-costs", "1,1,1,0,1.5"], "--zb-costs"),
    "missing-profile-file": (["--pipeline-schedule", "zb-1p", "--zb-costs", "/no/such/profile.json"], "--zb-costs"),
    "limit-below-one": (["--pipeline-schedule", "zb-2p", "--zb-memory-limit", "0.5"], "--zb-memory-limit"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_zb_flags_exit_2_with_one_line(case: str, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    import torch.distributed as dist

    from megatron.trainer.plan.parse import parse_args

    def forbidden(*args, **kwargs):
        raise AssertionError("a process group was started during argument validation")

    monkeypatch.setattr(dist, "init_process_group", forbidden)
    argv, flag = BAD[case]
    with pytest.raises(SystemExit) as info:
        parse_args([*BASE, *argv])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("error: ") and flag in lines[0], err


def test_zb_flags_become_schedule_options(tmp_path) -> None:
    from megatron.trainer.plan.parse import parse_args
    from megatron.trainer.config.run_config import schedule_config

    def options(*extra):
        return schedule_config(parse_args([*BASE, *extra])).options

    assert options("--pipeline-schedule", "zb-2p").profile_iters == 2  # profiling by default
    assert options("--pipeline-schedule", "zb-1p", "--zb-profile-iters", "3").profile_iters == 3
    fixed = options("--pipeline-schedule", "zb-2p", "--zb-costs", "1,1.5,0.5,0.1,0.4", "--zb-memory-limit", "6")
    assert not fixed.profile_iters and fixed.memory_limit == 6.0
    assert fixed.costs == (OpCosts(1.0, 1.5, 0.5, t_comm=0.1, m_w=0.4),) * 4
    assert options("--pipeline-schedule", "1f1b") == PostValidationOptions()
    # The object the trainer logs after profiling, saved to a file, fixes the same costs.
    schedule = profiled()
    schedule.set_costs(COSTS)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(schedule.describe()))
    from_file = options("--pipeline-schedule", "zb-2p", "--zb-costs", str(path))
    assert from_file.costs == COSTS
    fixed_schedule = build_schedule("zb-2p", ScheduleConfig(4, 8, 4, options=from_file))
    assert fixed_schedule.plan is schedule.target.plan
