"""PipeDream-2BW: valid streams, zero forward/backward drift measured on the weights the passes
read, two weight versions at most, the 1-stale recursion W(t+1) = W(t) - lr grad f(W(t-1))
against an independent float64 computation, the simulator's view, and runtime == emulator."""
from __future__ import annotations

import pytest
import torch

from megatron.pipeline.schedules import ScheduleConfig, ScheduleConfigError, build_schedule
from megatron.pipeline.simulator import simulate_schedule
from megatron.pipeline.schedule_check import check_schedule
from tests import tiny_pipeline as tiny
from tests.async_helpers import assert_runtime_equals_emulator, emulate, tiny_args


@pytest.mark.parametrize("num_stages", range(2, 9))
def test_schedule_check_accepts_generated_streams(num_stages: int) -> None:
    for a in (num_stages - 1, num_stages, 2 * num_stages):
        for drain_every in (None, 1, 3):
            check_schedule(build_schedule("pipedream-2bw", ScheduleConfig(num_stages, a, 5, drain_every=drain_every)))


def test_rejects_fewer_than_n_minus_1_microbatches_per_update() -> None:
    with pytest.raises(ScheduleConfigError, match="at least N - 1 = 3"):
        build_schedule("pipedream-2bw", ScheduleConfig(4, 2, 5))


def _one_stale_reference(num_stages: int, a: int, iterations: int) -> list[list[torch.Tensor]]:
    """W(t+1) = W(t) - lr(t+1) * grad f_t(W(t-1)), W(-1) = W(0): whole model, no pipeline."""
    lr = tiny.ScaledLR()
    prev = cur = tiny.initial_weights(num_stages)
    trajectory = [cur]
    for t in range(iterations):
        grad = tiny.window_gradient(prev, t, a)
        prev, cur = cur, [w.clone().add_(g, alpha=-lr.lr(t + 1)) for w, g in zip(cur, grad)]
        trajectory.append(cur)
    return trajectory


@pytest.mark.parametrize("num_stages,a", [(4, 3), (4, 5), (3, 2)])
def test_trajectory_is_the_one_stale_recursion_with_zero_measured_drift(num_stages: int, a: int) -> None:
    iterations = 6
    run = tiny.run("pipedream-2bw", num_stages, a, iterations)
    reference = _one_stale_reference(num_stages, a, iterations)
    for s, opt in enumerate(run.optimizers):
        assert len(opt.history) == iterations + 1
        for t, weights in enumerate(opt.history):
            assert torch.equal(weights[0], reference[t][s]), (s, t)
    for module in run.modules:  # every backward read exactly what its forward saved
        assert module.saved.keys() == module.read.keys() == set(range(iterations * a))
        assert all(torch.equal(module.saved[mb], module.read[mb]) for mb in module.saved)
    for w in run.workers:
        assert dict(w.drift_histogram) == {0: iterations * a}
        assert w.weights.peak_versions_alive == 2


def test_control_without_stashing_the_trajectory_differs() -> None:
    """PACI runs the same streams on live weights: its backwards read newer weights, so the test
    above can tell."""
    run = tiny.run("paci", 4, 3, 6)
    reference = _one_stale_reference(4, 3, 6)
    assert not all(torch.equal(o.history[-1][0], reference[-1][s]) for s, o in enumerate(run.optimizers))
    assert any(not torch.equal(m.saved[mb], m.read[mb]) for m in run.modules for mb in m.saved)


def test_gpt_drift_zero_and_exactly_two_weight_versions(megatron_world1) -> None:
    workers = emulate(tiny_args(4, "pipedream-2bw", 3, 5, "--pipeline-executor", "emulator"))
    for w in workers:
        assert set(w.drift_histogram) == {0}, (w.stage, dict(w.drift_histogram))
        assert w.weights.peak_versions_alive == w.weights.versions_alive == 2
        weight_bytes = sum(p.numel() * p.element_size() for p in w.setup.optimizer.parameters())
        assert w.weights.extra_weight_bytes == weight_bytes  # one extra copy, no more


def test_simulator_reports_no_drift_and_the_extra_weight_copy() -> None:
    config = ScheduleConfig(4, 4, 6)
    twobw = simulate_schedule(build_schedule("pipedream-2bw", config))
    paci = simulate_schedule(build_schedule("paci", config))
    assert twobw.makespan == paci.makespan and twobw.peak_memory == paci.peak_memory
    assert paci.max_drift == [1, 1, 1, 0] and twobw.max_drift == [0, 0, 0, 0]
    assert twobw.weight_memory == [2.0] * 4 and paci.weight_memory == [1.0] * 4


def test_distributed_runtime_equals_emulator_bitwise(megatron_world1, tmp_path) -> None:
    argv = tiny_args(4, "pipedream-2bw", 3, 5, "--hidden-dropout", "0.1")
    records, _ = assert_runtime_equals_emulator(argv, tmp_path / "dist")
    assert all(r["drift_max"] == [0, 0, 0, 0] for r in records)
