"""PipeMare: streams (synchronous warm-up, then asynchronous 1F1B), T1's per-stage learning rates
and T2's corrected backward weights against the spec's formulas computed apart, Lemma 1's
stability threshold and T2's effect on the paper's quadratic model, flags, and the runtime."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron.pipeline.ir import Op, OpKind
from megatron.pipeline.schedules import ScheduleConfig, build_schedule, schedule_class
from megatron.pipeline.schedules.asynchronous.pipemare import PipeMareOptions, RescheduledLR, stage_delay
from megatron.pipeline.schedule_check import check_schedule
from megatron.pipeline.runtime.weight_versions import DiscrepancyCorrection, build_weight_policy
from megatron.pipeline.weight_policy import DiscrepancyCorrected
from tests import paci_oracle
from tests import tiny_pipeline as tiny
from tests.async_helpers import assert_runtime_equals_emulator, tiny_args


def _config(n: int, a: int, iterations: int | None, first: int = 0, drain_every: int | None = None,
            **opts: object) -> ScheduleConfig:
    return ScheduleConfig(n, a, iterations, drain_every=drain_every, first_iteration=first,
                          options=PipeMareOptions(**opts))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ streams


@pytest.mark.parametrize("num_stages", range(2, 9))
def test_schedule_check_accepts_generated_streams(num_stages: int) -> None:
    for a in (1, num_stages, 2 * num_stages):
        for warmup in (0, 2):
            for drain_every in (None, 3):
                check_schedule(build_schedule("pipemare", _config(num_stages, a, 5, drain_every=drain_every,
                                                                     sync_warmup_iters=warmup)))


@pytest.mark.parametrize("first", [0, 1, 3])
def test_warmup_runs_1f1b_flush_then_the_asynchronous_stream(first: int) -> None:
    """Iterations below W are exactly 1F1B-flush's, the rest exactly PACI's (segments included)."""
    n, a, warmup, end = 4, 2, 2, 6
    pipemare = build_schedule("pipemare", _config(n, a, end - first, first=first, sync_warmup_iters=warmup))
    sync_part = max(0, warmup - first)
    flush = build_schedule("1f1b", ScheduleConfig(n, a, sync_part, first_iteration=first)) if sync_part else None
    paci = build_schedule("paci", ScheduleConfig(n, a, end - max(first, warmup), first_iteration=max(first, warmup)))
    for s in range(n):
        expected = (list(flush.stage_ops(s)) if flush else []) + list(paci.stage_ops(s))
        assert list(pipemare.stage_ops(s)) == expected


def test_stage_delays_follow_the_stream_by_default_and_table_1_on_request() -> None:
    # Default: the stream's delay ceil((N - 1 - s) / a), 0-based s (PACI's bound).
    assert [stage_delay(4, s, 2) for s in range(4)] == [2, 1, 1, 0]
    assert [stage_delay(4, s, 1) for s in range(4)] == [3, 2, 1, 0]
    assert [stage_delay(4, s, 2, "1f1b") for s in range(4)] == [2, 1, 1, 0]  # the old name
    # Spec Table 1 with i = s + 1: ceil((2 (P - i) + 1) / N); P = 4, N = 2.
    assert [stage_delay(4, s, 2, "paper") for s in range(4)] == [4, 3, 2, 1]
    assert [stage_delay(8, s, 3, "paper") for s in range(8)] == [5, 5, 4, 3, 3, 2, 1, 1]


# ------------------------------------------------------------------------------ T1


@pytest.mark.parametrize("model", ["paper", "stream", "1f1b"])
def test_t1_learning_rate_of_every_stage_and_update(model: str) -> None:
    n, a, iters, anneal, warmup = 4, 2, 9, 4, 2
    run = tiny.run("pipemare", n, a, iters, PipeMareOptions(lr_anneal_iters=anneal, sync_warmup_iters=warmup,
                                                                     delay_model=model))
    base = tiny.ScaledLR()
    for s, worker in enumerate(run.workers):
        if model == "paper":
            tau = math.ceil((2 * (n - s - 1) + 1) / a)
        else:
            tau = math.ceil((n - s - 1) / a)
        lrs = [entry["lr"] for entry in worker.update_log]
        expected = []
        for k in range(iters):
            alpha = base.lr(k + 1)
            if k >= warmup and tau > 0:
                alpha /= tau ** (1 - min((k - warmup) / anneal, 1))
            expected.append(alpha)
        assert lrs == pytest.approx(expected, rel=1e-15, abs=0), s
    first_async = [w.update_log[warmup]["lr"] for w in run.workers]
    assert first_async[0] < first_async[-1]  # earlier stages, longer delays, smaller steps


# ------------------------------------------------------------------------------ T2


def _backward_versions(name: str, config: ScheduleConfig, stage: int, kind: OpKind = OpKind.BW) -> dict[int, int]:
    """Micro-batch -> number of the stage's updates before its backward (or ``kind``), read off the stream."""
    updates, out = 0, {}
    for op in build_schedule(name, config).stage_ops(stage):
        if op.kind is OpKind.OPT:
            updates += 1
        elif op.kind is kind:
            out[op.microbatch] = updates
    return out


def _velocity(history: list[torch.Tensor], gamma: float) -> list[torch.Tensor]:
    """delta_0 = 0, delta_{k+1} = gamma delta_k + (1 - gamma)(w_{k+1} - w_k)."""
    deltas = [torch.zeros_like(history[0])]
    for prev, new in zip(history, history[1:]):
        deltas.append(gamma * deltas[-1] + (1 - gamma) * (new - prev))
    return deltas


def test_t2_is_a_spec_the_runtime_builds() -> None:
    """The schedule describes T2 per stage as torch-free data; build_weight_policy makes the
    policy from exactly those fields (the runs below check what the policy then does)."""
    n, a = 4, 2
    config = _config(n, a, 5, discrepancy_decay=0.3, sync_warmup_iters=1, delay_model="stream")
    cls = schedule_class("pipemare")
    specs = list(cls.traits.policy_for(config).weight_policies)
    assert specs[-1] is None  # the last stage has no delay: live weights
    tau = stage_delay(n, 0, a, "stream")
    assert specs[0] == DiscrepancyCorrected(tau, 0.3, a, sync_until=1, measured_delay=True)
    p = torch.nn.Parameter(torch.ones(2))
    opt = SimpleNamespace(step_count=0, parameters=lambda: [p])
    policy = build_weight_policy(specs[0], opt)
    assert isinstance(policy, DiscrepancyCorrection) and policy.params == [p]
    assert (policy.tau, policy.gamma, policy.a, policy.sync_until, policy.measured_delay) == (
        tau, 0.3 ** (1 / tau), a, 1, True)
    assert build_weight_policy(None, opt) is None
    with pytest.raises(TypeError, match="no weight policy"):
        build_weight_policy(object(), opt)  # type: ignore[arg-type]


@pytest.mark.parametrize("model", ["stream", "paper"])
def test_t2_backward_reads_the_extrapolated_weights(model: str) -> None:
    n, a, iters, decay, warmup = 4, 1, 8, 0.3, 2
    options = PipeMareOptions(discrepancy_decay=decay, sync_warmup_iters=warmup, delay_model=model)
    run = tiny.run("pipemare", n, a, iters, options)
    config = ScheduleConfig(n, a, iters, options=options)
    corrected = 0
    for s, (module, opt) in enumerate(zip(run.modules, run.optimizers)):
        tau = 2 * (n - s - 1) + 1 if model == "paper" else n - s - 1  # Table 1 / the stream, a = 1
        history = [weights[0] for weights in opt.history]
        deltas = _velocity(history, decay ** (1 / max(tau, 1)))
        forwards = _backward_versions("pipemare", config, s, OpKind.F)
        for mb, k in _backward_versions("pipemare", config, s).items():
            steps = tau if model == "paper" else k - forwards[mb]  # the stream: this micro-batch's delay
            if mb // a < warmup or s == n - 1 or steps == 0:  # synchronous warm-up, or no delay: nothing to correct
                assert torch.equal(module.read[mb], module.saved[mb])
            else:
                assert torch.allclose(module.read[mb], history[k] - steps * deltas[k], rtol=0, atol=1e-12), (s, mb)
                corrected += not torch.equal(module.read[mb], history[k])
        # one float64 3x3 delta, none on the last stage, where T2 is off
        assert run.workers[s].weights.extra_weight_bytes == (0 if s == n - 1 else 9 * 8)
    assert corrected > 10  # the correction was not vacuous


def _mismatch_ratios(n: int, a: int, iters: int, decay: float, model: str) -> list[float | None]:
    """Per stage, sum over micro-batches of ||backward-read - forward-saved|| over the same sum
    for the live weights at backward time (None: no mismatch to reduce). What each pass read is
    recorded by the tiny model's saved-tensor hooks and checked against an independent
    computation: the forward of micro-batch m on stage s reads version floor(max(0, m - (N-1-s)) / a),
    its backward the live version floor(m / a) moved back by its delay d times T2's velocity
    (tests/paci_oracle.py: PACI's Algorithm 1)."""
    run = tiny.run("pipemare", n, a, iters, PipeMareOptions(discrepancy_decay=decay, delay_model=model))
    ratios: list[float | None] = []
    for s, (module, opt) in enumerate(zip(run.modules, run.optimizers)):
        tau = stage_delay(n, s, a, model)
        history = [weights[0] for weights in opt.history]
        deltas = _velocity(history, decay ** (1 / max(tau, 1)))
        corrected = live = 0.0
        for mb in range(iters * a):
            k_f, k_b = paci_oracle.forward_version(n, s, a, mb), paci_oracle.backward_version(a, mb)
            assert torch.equal(module.saved[mb], history[k_f]), (s, mb)
            steps = k_b - k_f if model == "stream" else tau
            if paci_oracle.drift_bound(n, s, a) == 0 or steps == 0:  # no delay: T2 moves nothing
                assert torch.equal(module.read[mb], history[k_b]), (s, mb)
            else:
                assert torch.allclose(module.read[mb], history[k_b] - steps * deltas[k_b], rtol=0, atol=1e-12)
            corrected += float((module.read[mb] - module.saved[mb]).norm())
            live += float((history[k_b] - module.saved[mb]).norm())
        ratios.append(corrected / live if live else None)
        if not live:
            assert corrected == 0.0, s  # T2 created no mismatch where none existed
    return ratios


@pytest.mark.parametrize("n,a", [(4, 1), (4, 2), (6, 2)])
def test_t2_with_the_stream_delay_reduces_the_mismatch_on_every_delayed_stage(n: int, a: int) -> None:
    ratios = _mismatch_ratios(n, a, 12, 0.3, "stream")
    assert ratios[-1] is None  # the last stage has no mismatch, and T2 made none
    assert all(r is not None and r < 0.9 for r in ratios[:-1]), ratios


def test_t2_with_the_papers_longer_delay_overshoots_on_this_stream() -> None:
    """Table 1's delay is about twice this stream's: extrapolating that far makes the mismatch
    worse than no correction (why it is opt-in), yet still creates none on the last stage."""
    ratios = _mismatch_ratios(4, 2, 12, 0.3, "paper")
    assert ratios[-1] is None
    assert all(r is not None and r > 1.0 for r in ratios[:-1]), ratios


def test_t2_restores_the_live_weights_exactly() -> None:
    """Forwards read the live weights bitwise although backwards in between read corrected ones,
    and with the whole run in synchronous warm-up PipeMare is 1F1B-flush bitwise."""
    n, a, iters = 4, 1, 6
    run = tiny.run("pipemare", n, a, iters, PipeMareOptions(discrepancy_decay=0.3, lr_anneal_iters=3))
    config = ScheduleConfig(n, a, iters)
    for s, (module, opt) in enumerate(zip(run.modules, run.optimizers)):
        updates = 0
        for op in build_schedule("paci", config).stage_ops(s):
            updates += op.kind is OpKind.OPT
            if op.kind is OpKind.F:
                assert torch.equal(module.saved[op.microbatch], opt.history[updates][0])
    warm = tiny.run("pipemare", n, a, iters, PipeMareOptions(discrepancy_decay=0.3, lr_anneal_iters=3,
                                                                        sync_warmup_iters=iters))
    flush = tiny.run("1f1b", n, a, iters)
    for o, f in zip(warm.optimizers, flush.optimizers):
        assert all(torch.equal(x[0], y[0]) for x, y in zip(o.history, f.history))


# ------------------------------------------------------------------------------ theory (spec A.6)


def _lemma1_radius(alpha: float, tau: int, lam: float = 1.0) -> float:
    """Largest root modulus of p(w) = w^(tau+1) - w^tau + alpha lam."""
    return float(max(abs(np.roots([1.0, -1.0] + [0.0] * (tau - 1) + [alpha * lam]))))


@pytest.mark.parametrize("tau", [1, 2, 5, 10, 20, 40])
def test_lemma1_threshold_and_t1_rate(tau: int) -> None:
    threshold = 2 * math.sin(math.pi / (4 * tau + 2))
    assert _lemma1_radius(0.999 * threshold, tau) < 1 < _lemma1_radius(1.001 * threshold, tau)
    # T1's first asynchronous rate alpha / tau is inside the stable range for alpha = 0.9, while
    # alpha itself is not once tau >= 2 (Lemma 1's O(1/tau) rule).
    t1 = RescheduledLR(SimpleNamespace(lr=lambda step: 0.9), tau=tau, anneal_iters=100).lr(1)
    assert t1 == pytest.approx(0.9 / tau) and _lemma1_radius(t1, tau) < 1
    assert (_lemma1_radius(0.9, tau) > 1) == (tau >= 2)


def _companion(alpha: float, lam: float, delta: float, tf: int, tb: int, decay: float | None) -> np.ndarray:
    """State matrix of w_{t+1} = w_t - alpha((lam + Delta) w_{t-tf} - Delta u_t), u_t = w_{t-tb} -
    (tf - tb) d_t, d_{t+1} = g d_t + (1 - g)(w_{t+1} - w_t) (d = 0 without T2), on the state
    (w_t, ..., w_{t-tf}, d_t)."""
    n = tf + 2
    row = np.zeros(n)
    row[0] += 1.0
    row[tf] -= alpha * (lam + delta)
    row[tb] += alpha * delta
    matrix = np.zeros((n, n))
    for i in range(1, tf + 1):
        matrix[i, i - 1] = 1.0
    if decay is not None:
        gamma = decay ** (1.0 / (tf - tb))
        row[n - 1] -= alpha * delta * (tf - tb)
        matrix[n - 1] = (1 - gamma) * (row - np.eye(n)[0])
        matrix[n - 1, n - 1] += gamma
    matrix[0] = row
    return matrix


def _radius(*model: float | None) -> float:
    return float(max(abs(np.linalg.eigvals(_companion(*model)))))  # type: ignore[arg-type]


def test_t2_stabilises_the_discrepancy_model_of_figure_6b() -> None:
    """Spec A.6 [X]: tau_fwd = 10, tau_bkwd = 6, Delta = 5, alpha = 0.05."""
    assert _radius(0.05, 1, 0, 10, 6, None) == pytest.approx(0.930, abs=5e-4)
    assert _radius(0.05, 1, 5, 10, 6, None) == pytest.approx(1.017, abs=5e-4)
    assert _radius(0.05, 1, 5, 10, 6, 0.1) == pytest.approx(0.970, abs=5e-4)


@pytest.mark.parametrize("decay", [0.1, None])
def test_discrepancy_correction_policy_on_the_quadratic_model(decay: float | None) -> None:
    """Our T2 policy drives the paper's discrepancy model (tau_bkwd = 0): the trajectory is the
    companion matrix's, which is stable with T2 (D = 0.1) and unstable without."""
    tf, alpha, lam, delta, steps = 10, 0.05, 1.0, 5.0, 200
    p = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))
    opt = SimpleNamespace(step_count=0)
    policy = None if decay is None else DiscrepancyCorrection([p], opt, tf, decay, 1)
    history = [p.detach().clone()] * (tf + 1)
    for t in range(steps):
        op = Op(OpKind.BW, 0, microbatch=t)
        if policy:
            policy.before_backward(op)
        grad = (lam + delta) * history[-1 - tf] - delta * p.detach()
        if policy:
            policy.after_backward(op)
            policy.before_update(Op(OpKind.OPT, 0, update=t))
        p.data.add_(grad, alpha=-alpha)
        opt.step_count += 1
        if policy:
            policy.after_update(Op(OpKind.OPT, 0, update=t))
        history.append(p.detach().clone())
    matrix = _companion(alpha, lam, delta, tf, 0, decay)
    state = np.linalg.matrix_power(matrix, steps) @ np.concatenate([np.ones(tf + 1), [0.0]])
    ours = np.array([float(h) for h in history[::-1][: tf + 1]])
    assert np.allclose(ours, state[: tf + 1], rtol=1e-9, atol=1e-12)
    radius = _radius(alpha, lam, delta, tf, 0, decay)
    assert (radius < 1) == (decay is not None)
    assert (abs(ours[0]) < 1e-2) if decay is not None else (abs(ours[0]) > 1e3)


# ------------------------------------------------------------------------------ trainer


@pytest.mark.parametrize("flags", [("--pipeline-schedule", "paci", "--pipemare-lr-anneal-iters", "5"),
                                   ("--pipeline-schedule", "pipemare", "--pipemare-discrepancy-decay", "1.5"),
                                   ("--pipeline-schedule", "pipemare", "--pipemare-lr-anneal-iters", "0")])
def test_bad_flags_fail_before_training(flags: tuple[str, ...]) -> None:
    from megatron.trainer.plan.parse import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args([*tiny_args(2, "pipemare", 2, 4), *flags])
    assert exc.value.code == 2


PIPEMARE_FLAGS = ("--pipemare-lr-anneal-iters", "3", "--pipemare-discrepancy-decay", "0.1",
                  "--pipemare-sync-warmup-iters", "1")


def test_distributed_runtime_equals_emulator_bitwise(megatron_world1, tmp_path) -> None:
    argv = tiny_args(4, "pipemare", 1, 6, "--hidden-dropout", "0.1", *PIPEMARE_FLAGS)
    records, workers = assert_runtime_equals_emulator(argv, tmp_path / "dist")
    assert records[0]["drift_max"] == [0, 0, 0, 0]  # synchronous warm-up
    assert records[-1]["drift_max"] == [3, 2, 1, 0]  # then 1F1B's asynchronous drift
    assert [w.setup.lr_schedule.tau for w in workers] == [3, 2, 1, 0]  # the stream's delay
