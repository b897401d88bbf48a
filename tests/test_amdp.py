"""AMDP: D/2 replicated pipelines in alternating directions with windowed updates.

Independent references:
- the placement, by brute force over every even D up to 16: bijections, alternating
  directions over neighbouring devices, every device hosting each pipeline once with
  distinct logical stages, the released code's tables for D = 4 and 8 (spec B.2.4), and sync
  groups that are closed under replicas and partition the devices;
- the streams: the schedule check replays them (D in {2, 4, 6, 8}); at most K = 2 micro-batches
  between forward and backward on every chunk; drift counted from the streams' own OPTs
  at most K - 1 = 1 (spec Lemma 3.1) and 0 outside the first D micro-batches of a window.
  (The Lemma's tighter min(K, D - s) - 1 = 0 on the last stage assumes per-micro-batch
  updates; with a window step between the first block's forwards and backwards, as in the
  released code, the last stage's first-block micro-batches also cross the step.)
- the emulator: drift measured by the workers (D in {4, 6, 8}), replicas bitwise equal after
  every update, and one window equal to the synchronous 1F1B step over the same T
  micro-batches (the window's update is the mean gradient over all pipelines);
- the distributed runtime equals the emulator bitwise (N = 4, dropout and clipping on);
- the timing simulator's makespan, bubble, activation memory and drift.
"""
from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch

from megatron.pipeline.runtime.executors.emulator import Emulator
from megatron.pipeline.ir import MultiPipelineLayout, OpKind
from megatron.pipeline.schedules import ScheduleConfig, ScheduleConfigError, build_schedule
from megatron.pipeline.schedules.asynchronous.amdp import AMDP, K, PRELOAD
from megatron.pipeline.costs.op_costs import OpCosts
from megatron.pipeline.simulator import simulate_schedule
from megatron.pipeline.simulator import steady_time_per_update as simulator_steady_time
from megatron.pipeline.schedule_check import check_schedule
from megatron.pipeline.runtime.worker import StageWorker
from megatron.trainer.plan.parse import parse_args
from megatron.trainer.tasks.gpt import GPTTask
from tests.async_helpers import assert_runtime_equals_emulator, emulate, tiny_args


def layout(d: int) -> MultiPipelineLayout:
    return MultiPipelineLayout(d, max(1, d // 2))


# ----------------------------------------------------------------------------- placement


@pytest.mark.parametrize("d", range(2, 18, 2))
def test_placement_properties_by_brute_force(d: int) -> None:
    lay = layout(d)
    for p in range(lay.num_pipelines):
        devices = [lay.device(p, j) for j in range(d)]
        assert sorted(devices) == list(range(d)), (p, devices)
        step = 1 if p % 2 == 0 or d % 4 == 2 else -1  # even pipelines run down, odd ones up (D = 0 mod 4)
        assert all((devices[j + 1] - devices[j]) % d == step % d for j in range(d - 1))
        assert all(lay.logical_stage(devices[j], p) == j for j in range(d))
        assert all(lay.next_hop(devices[j], p) == ((devices[j + 1], p) if j < d - 1 else None) for j in range(d))
        assert all(lay.prev_hop(devices[j], p) == ((devices[j - 1], p) if j > 0 else None) for j in range(d))
    for s in range(d):
        hosted = [lay.logical_stage(s, c) for c in range(lay.num_chunks)]
        assert len(set(hosted)) == len(hosted), (s, hosted)
    groups = {lay.sync_group(s) for s in range(d)}
    assert sorted(x for g in groups for x in g) == list(range(d))  # a partition
    for j in range(d):
        replica_devices = {dev for dev, _ in lay.replicas(j)}
        assert len(replica_devices) == lay.num_pipelines
        assert any(replica_devices <= set(g) for g in groups)  # closed under replicas


@pytest.mark.parametrize("d", [4, 6, 8])
def test_sync_groups_are_the_devices_that_hold_the_same_stages(d: int) -> None:
    lay = layout(d)
    hosted = {s: frozenset(lay.logical_stage(s, c) for c in range(lay.num_chunks)) for s in range(d)}
    for s in range(d):
        group = lay.sync_group(s)
        assert len(group) == lay.num_pipelines < d  # P devices, never all of them
        assert all(hosted[g] == hosted[s] for g in group)  # the devices of one group hold the same stages
        assert set(group) == {dev for j in hosted[s] for dev, _ in lay.replicas(j)}


def test_no_bidirectional_placement_has_smaller_sync_groups_at_d6() -> None:
    # Why D = 2 (mod 4) runs every pipeline down (MultiPipelineLayout's docstring), by brute
    # force: pipeline 0 fixed to the identity, the others any cyclic path in either direction.
    d, paths = 6, [tuple((o + k * j) % 6 for j in range(6)) for o in range(6) for k in (1, -1)]
    smallest = {}
    for rest in ((a, b) for a in paths for b in paths):
        pipes = (tuple(range(d)), *rest)
        if any(len({pipe.index(s) for pipe in pipes}) < 3 for s in range(d)):
            continue  # a device would host one stage twice
        parent = list(range(d))  # union-find over devices holding replicas of one stage
        def root(x: int) -> int:
            while parent[x] != x:
                x = parent[x]
            return x
        for j in range(d):
            for pipe in pipes[1:]:
                parent[root(pipe[j])] = root(pipes[0][j])
        bidirectional = any((pipe[1] - pipe[0]) % d == d - 1 for pipe in pipes)
        size = max(sum(root(x) == root(y) for x in range(d)) for y in range(d))
        smallest[bidirectional] = min(smallest.get(bidirectional, d), size)
    assert smallest == {True: d, False: d // 2}


def test_placement_matches_the_released_code() -> None:
    # spec B.2.4: D = 8, code chunk c puts stage s on GPU ...; D = 4: s and 3 - s
    code8 = {tuple(f(s) % 8 for s in range(8)) for f in (lambda s: s, lambda s: 11 - s, lambda s: s + 4, lambda s: 7 - s)}
    assert {tuple(layout(8).device(p, s) for s in range(8)) for p in range(4)} == code8
    assert {tuple(layout(4).device(p, s) for s in range(4)) for p in range(2)} == {(0, 1, 2, 3), (3, 2, 1, 0)}
    assert {layout(8).sync_group(s) for s in range(8)} == {(0, 3, 4, 7), (1, 2, 5, 6)}
    assert {layout(4).sync_group(s) for s in range(4)} == {(0, 3), (1, 2)}


# ----------------------------------------------------------------------------- streams


def amdp(d: int, t: int, iterations: int = 3, drain_every: int | None = None) -> AMDP:
    schedule = build_schedule("amdp", ScheduleConfig(d, t, num_iterations=iterations, drain_every=drain_every))
    assert isinstance(schedule, AMDP)
    return schedule


def window_drift_bound(mb: int, t: int, d: int) -> int:
    """The windowed-update bound, derived: a backward of window w = mb // t runs after step
    w - 1 and before step w; a forward runs after step w - 1, or, in the first D micro-batches
    of the window only, after step w - 2. So 1 step at most, and none after the first block."""
    earliest_forward_version = max(0, mb // t - (1 if mb % t < d else 0))
    return mb // t - earliest_forward_version


def stream_drift(schedule: AMDP) -> dict[tuple[int, int], int]:
    """(micro-batch, logical stage) -> OPTs between its F and BW, counted from the streams."""
    lay, drift = schedule.layout, {}
    for stream in schedule.streams():
        version, at_forward = 0, {}
        for op in stream:
            if op.kind is OpKind.OPT:
                version += 1
            elif op.kind is OpKind.F:
                at_forward[op.microbatch] = version
            elif op.kind is OpKind.BW:
                drift[(op.microbatch, lay.model_stage(op.stage, op.chunk))] = version - at_forward[op.microbatch]
    return drift


@pytest.mark.parametrize("d", [2, 4, 6, 8])
def test_schedule_check_accepts_amdp(d: int) -> None:
    for t in (d, 2 * d):
        assert check_schedule(amdp(d, t))
    assert check_schedule(amdp(d, d, iterations=4, drain_every=2))


@pytest.mark.parametrize("d", [4, 6, 8])
def test_injection_limit_and_drift_bound_from_the_streams(d: int) -> None:
    t = 2 * d
    schedule = amdp(d, t)
    for stream in schedule.streams():
        open_: dict[int, int] = defaultdict(int)
        for op in stream:
            if op.kind is OpKind.F:
                open_[op.chunk] += 1
                assert open_[op.chunk] <= K + PRELOAD, op  # 2 per pipeline, plus the preload
            elif op.kind is OpKind.BW:
                open_[op.chunk] -= 1
    drift = stream_drift(schedule)
    assert len(drift) == 3 * t * d
    for (mb, j), tau in drift.items():
        assert tau <= window_drift_bound(mb, t, d), (mb, j, tau)
    assert max(drift.values()) == 1  # the first block of later windows does cross an update


def test_config_errors() -> None:
    with pytest.raises(ScheduleConfigError, match="even number"):
        amdp(3, 6)
    with pytest.raises(ScheduleConfigError, match="multiple of the pipeline depth 4"):
        amdp(4, 6)
    for argv, what in ((tiny_args(4, "amdp", 6, 2), "multiple"), (tiny_args(3, "amdp", 6, 2), "even"),
                       (tiny_args(2, "amdp", 4, 2, "--data-parallel-size", "2"), "data-parallel")):
        with pytest.raises(SystemExit):
            parse_args(argv)


def test_simulator_makespan_bubble_memory_drift() -> None:
    d, t = 8, 16
    result = simulate_schedule(amdp(d, t, iterations=2), OpCosts(t_f=1, t_bw=2))
    lay = layout(d)
    assert all(busy == 2 * t * 3 for busy in result.busy)  # every device: 2T forwards+backwards of cost 3
    assert result.makespan >= 2 * t * 3 and 0 <= result.bubble_rate < 0.5
    assert all(peak <= (K + PRELOAD) * lay.num_pipelines for peak in result.peak_memory)  # per hosted stage
    assert max(result.max_drift) == 1
    assert result.weight_memory == [lay.num_pipelines] * d  # one stage replica per pipeline: W/2
    for s, per_mb in enumerate(result.drift):
        assert all(tau == 0 for mb, tau in per_mb.items() if mb % t >= d)


def steady_time_per_update(name: str, d: int, t: int, costs: object, k: int = 6) -> float:
    """The simulator's marginal time of one update (steady state, the benchmarks' measure)."""
    return simulator_steady_time(lambda i: build_schedule(name, ScheduleConfig(d, t, num_iterations=i)), k, costs)


@pytest.mark.parametrize("t_mult", [1, 2, 4])
def test_bubble_filling_beats_1f1b_flush_and_matches_or_beats_2bw(t_mult: int) -> None:
    # AMDP's setting: D = 8, t_B = 2 t_F, T in {D, 2D, 4D}, the same micro-batches per update
    # for every schedule. 1F1B-flush's time is checked against its closed form (T + D - 1)(t_F +
    # t_B); the bubble-free time is T (t_F + t_B). Uniform stages: 2BW is bubble-free, so AMDP
    # can at best tie it; the preload keeps it within 9 % of the bubble-free time. Heavier last
    # part (the LM head: 6 of the paper's 48 GPT layers plus a 50257 x 1600 head ~ 2.4 layers,
    # so 1.4x): 2BW and 1F1B run at the slowest stage's pace while AMDP spreads the replicas
    # of the heavy part over D/2 devices, which is where the paper's lead over 2BW comes from
    # (1.07-1.17x at D = 8, Table 3).
    d, t = 8, 8 * t_mult
    uniform = OpCosts(t_f=1, t_b=2, t_w=0, t_bw=2)
    flush, ours, tbw = (steady_time_per_update(n, d, t, uniform) for n in ("1f1b", "amdp", "pipedream-2bw"))
    assert flush == (t + d - 1) * 3 and tbw == t * 3
    assert flush / ours >= 1.0 and ours <= 1.09 * t * 3, (flush / ours, ours)
    heavy = [uniform] * (d - 1) + [OpCosts(t_f=1.4, t_b=2.8, t_w=0, t_bw=2.8)]
    flush, ours, tbw = (steady_time_per_update(n, d, t, heavy) for n in ("1f1b", "amdp", "pipedream-2bw"))
    assert flush / ours >= 1.0 and tbw / ours >= 1.05, (flush / ours, tbw / ours)


# ----------------------------------------------------------------------------- emulator


def record_measured_drift(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[int, int, int], int]:
    """(device, micro-batch, chunk) -> the worker's version at BW minus at F."""
    measured: dict[tuple[int, int, int], int] = {}
    backward = StageWorker.backward

    def spy(self: StageWorker, op, grad):  # type: ignore[no-untyped-def]
        measured[(self.stage, op.microbatch, op.chunk)] = self.version - self._fwd_version[(op.microbatch, op.chunk)]
        return backward(self, op, grad)

    monkeypatch.setattr(StageWorker, "backward", spy)
    return measured


def check_replicas_after_every_update(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Compare every logical stage's replicas right after each window update; return a count."""
    checked: list[int] = []
    step = Emulator._execute_sync

    def spy(self: Emulator, ops):  # type: ignore[no-untyped-def]
        step(self, ops)
        lay = self.layout
        for j in {lay.logical_stage(op.stage, c) for op in ops for c in range(lay.num_chunks)}:
            params = [list(self.workers[dev].setup.chunks[c].parameters()) for dev, c in lay.replicas(j)]
            for other in params[1:]:
                assert all(torch.equal(a, b) for a, b in zip(params[0], other)), (ops, j)
            checked.append(j)

    monkeypatch.setattr(Emulator, "_execute_sync", spy)
    return checked


@pytest.mark.parametrize("d", [4, 6, 8])
def test_emulator_drift_and_identical_replicas(megatron_world1, monkeypatch, d: int) -> None:
    t, iterations = d, 3 if d == 4 else 2  # the second window's first block crosses an update
    measured = record_measured_drift(monkeypatch)
    checked = check_replicas_after_every_update(monkeypatch)
    workers = emulate(tiny_args(d, "amdp", t, iterations, "--pipeline-executor", "emulator", "--hidden-size", "8"))
    assert [w.version for w in workers] == [iterations] * d
    assert len(measured) == iterations * t * d  # every micro-batch on every device, once
    lay = workers[0].layout
    for (s, mb, chunk), tau in measured.items():
        assert chunk == mb % lay.num_chunks  # pipeline m mod P
        assert tau <= window_drift_bound(mb, t, d), (s, mb, tau)
    assert sum(measured.values()) > 0
    assert len(checked) == iterations * d  # each logical stage after each update


def test_nonfinite_gradient_skips_the_whole_sync_group(megatron_world1, keep_update_history) -> None:
    # A NaN on device 1 before update 1: its replica sums turn NaN on devices 1 and 2 (the
    # sync group {1, 2} of D = 4), which skip together; devices 0 and 3 step on.
    workers = emulate(tiny_args(4, "amdp", 4, 3, "--pipeline-executor", "emulator", "--inject-nonfinite-grad", "1:1"))
    assert [[e["skipped"] for e in w.update_log] for w in workers] == [
        [False] * 3, [False, True, False], [False, True, False], [False] * 3]
    for w in workers:
        assert all(torch.isfinite(p).all() for p in w.setup.optimizer.parameters())


def window_gradients(monkeypatch: pytest.MonkeyPatch) -> dict[str, torch.Tensor]:
    """Gradient each parameter is stepped with (by global name; replicas overwrite each other)."""
    grads: dict[str, torch.Tensor] = {}
    apply = StageWorker.apply_update

    def spy(self: StageWorker, op, norms):  # type: ignore[no-untyped-def]
        for name, p in GPTTask().named_parameters(self.setup.chunks):
            grads[name] = p.grad.detach().clone()
        return apply(self, op, norms)

    monkeypatch.setattr(StageWorker, "apply_update", spy)
    return grads


def test_one_window_is_the_synchronous_step_over_all_pipelines(megatron_world1, monkeypatch) -> None:
    # One window has no drift: the replicas' summed gradients are the mean over its T
    # micro-batches, the gradient of one 1F1B iteration over the same micro-batches
    # (summation order differs, hence allclose; the losses are bitwise equal).
    args = ("--pipeline-executor", "emulator", "--hidden-dropout", "0", "--attention-dropout", "0")
    grads = window_gradients(monkeypatch)
    emulate(tiny_args(4, "amdp", 8, 1, *args))
    ours = dict(grads)
    grads.clear()
    emulate(tiny_args(4, "1f1b", 8, 1, *args))
    assert ours.keys() == grads.keys()
    for name, value in grads.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-7, msg=name)


def test_distributed_runtime_equals_emulator_bitwise(megatron_world1, tmp_path) -> None:
    emu_log = tmp_path / "emu.jsonl"  # run_pretrain's own --log-json comes later and wins there
    argv = tiny_args(4, "amdp", 8, 2, "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--clip-grad", "0.5",
                     "--log-json", str(emu_log))
    records, workers = assert_runtime_equals_emulator(argv, tmp_path / "dist")
    emu_records = [json.loads(line) for line in emu_log.read_text().splitlines()]
    assert [(r["loss"], r["drift_max"]) for r in records] == [(r["loss"], r["drift_max"]) for r in emu_records]
    hosted = [name for w in workers for name, _ in GPTTask().named_parameters(w.setup.chunks)]
    assert len(hosted) == 2 * len(set(hosted))  # every parameter on two devices (D/2 = 2 replicas)


# ----------------------------------------------------------------------------- optimizer sharding


@pytest.mark.parametrize("d,extra", [(4, ("--bf16",)), (6, ("--clip-grad", "0.05")), (4, ("--fp16", "--initial-loss-scale", "1024"))])
def test_sharded_optimizer_state_is_bitwise_the_replicated_one_at_1_over_p_memory(megatron_world1, d: int,
                                                                                  extra: tuple[str, ...]) -> None:
    # ZeRO-1 over the D/2 replicas (paper §3.4): each replica steps its range of every stage it
    # hosts and all-gathers the rest. AdamW is element-wise, so weights and every owned moment /
    # fp32-master element equal the replicated run's bits (bf16, fp16: masters are sharded too,
    # fp16 with its loss scale; clipping: the clip coefficient is shared). Memory: 1/P per device, up to range rounding.
    base = ("--pipeline-executor", "emulator", "--hidden-size", "8", *extra)
    sharded = emulate(tiny_args(d, "amdp", d, 2, *base))
    replicated = emulate(tiny_args(d, "amdp", d, 2, *base, "--amdp-optimizer-state", "replicated"))
    p = layout(d).num_pipelines
    for ws, wr in zip(sharded, replicated):
        assert ws.version == wr.version == 2
        for a, b in zip(ws.setup.optimizer.parameters(), wr.setup.optimizer.parameters()):
            assert torch.equal(a, b)
        whole = {slot.name: slot for slot in wr.setup.optimizer._slots}
        for slot in ws.setup.optimizer._slots:
            lo, hi = slot.index
            ref = whole[slot.name]
            for mine, full in ((slot.exp_avg, ref.exp_avg), (slot.exp_avg_sq, ref.exp_avg_sq), (slot.master, ref.master)):
                assert (mine is None) == (full is None)
                if mine is not None:
                    assert torch.equal(mine, full.reshape(-1)[lo:hi]), slot.name
        full_bytes, shard_bytes = wr.setup.optimizer.state_bytes(), ws.setup.optimizer.state_bytes()
        per_element = 8 if "--clip-grad" in extra else 12  # two fp32 moments (+ an fp32 master in bf16/fp16)
        assert abs(shard_bytes - full_bytes / p) <= p * per_element, (ws.stage, shard_bytes, full_bytes)
    total_full = sum(w.setup.optimizer.state_bytes() for w in replicated)
    assert sum(w.setup.optimizer.state_bytes() for w in sharded) * p == total_full  # exactly 1/P overall


def test_sharding_flag_is_refused_where_it_cannot_work() -> None:
    for argv in (tiny_args(4, "1f1b", 4, 2, "--amdp-optimizer-state", "sharded"),
                 tiny_args(4, "amdp", 4, 2, "--optimizer", "basis-rotation", "--amdp-optimizer-state", "sharded")):
        with pytest.raises(SystemExit):
            parse_args(argv)


@pytest.mark.slow
def test_distributed_runtime_equals_emulator_bitwise_at_d6_sharded(megatron_world1, tmp_path) -> None:
    # D = 2 (mod 4): one-direction placement, sync groups {0,2,4} and {1,3,5}, sharded AdamW
    # state with fp32 masters (bf16): the runtime's all-gathers give the emulator's bits.
    argv = tiny_args(6, "amdp", 6, 2, "--bf16", "--clip-grad", "0.5", "--hidden-size", "8")
    assert_runtime_equals_emulator(argv, tmp_path / "dist")
