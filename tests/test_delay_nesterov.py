"""Tests for ``--optimizer delay-nesterov`` (megatron.trainer.optim.delay_nesterov).

One stage equals torch's ``NAdam(decoupled_weight_decay=True)`` with the delay-adapted beta1 bit
for bit; on a quadratic with a fixed gradient delay the optimizer follows a float64 oracle of the
update written out by hand; each asynchronous schedule's stages get the beta1 of their declared
delay; the distributed runtime equals the emulator bitwise; checkpoints resume bitwise;
synchronous schedules are refused in one line.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from async_helpers import (
    assert_emulated_resume_is_bitwise,
    assert_flag_error,
    assert_runtime_equals_emulator,
    emulate,
    final_params,
    tiny_args,
)
from test_checkpoint_resume import SCHEDULE_FLAGS
from test_optimizer import BETAS, EPS, LRS, WD, backward, make_model

from megatron.trainer.optim.delay_nesterov import DelayNesterovAdamW, Lookahead

PSI = 0.004


def test_beta1_grows_with_the_delay_up_to_the_ceiling() -> None:
    assert Lookahead(delay=0, num_stages=4).beta1(0.9) == 0.9
    assert Lookahead(delay=2, num_stages=4, max_momentum=0.98).beta1(0.9) == 0.9 + 2 * (0.98 - 0.9) / 4
    with pytest.raises(ValueError, match="below --adam-beta1"):
        Lookahead(delay=1, num_stages=2, max_momentum=0.5).beta1(0.9)


def test_one_stage_equals_torch_nadam_with_the_delay_adapted_beta1_bitwise() -> None:
    lookahead = Lookahead(delay=2, num_stages=4, momentum_decay=PSI)
    beta1 = lookahead.beta1(BETAS[0])
    ours_model, ref_model = make_model(), make_model()
    ours = DelayNesterovAdamW(list(ours_model.named_parameters()), lr=LRS[0], weight_decay=WD, betas=BETAS, eps=EPS,
                              lookahead=lookahead)
    assert ours.betas[0] == beta1 > BETAS[0]
    named = list(ref_model.named_parameters())
    decay = [p for n, p in named if not (n.endswith("bias") or p.ndim == 1)]
    no_decay = [p for n, p in named if n.endswith("bias") or p.ndim == 1]
    ref = torch.optim.NAdam([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LRS[0], betas=(beta1, BETAS[1]), eps=EPS, momentum_decay=PSI,
                            decoupled_weight_decay=True, foreach=False)
    for step, lr in enumerate(LRS):
        for model in (ours_model, ref_model):
            model.zero_grad()
            backward(model, step)
        ours.step(lr)
        for group in ref.param_groups:
            group["lr"] = lr
        ref.step()
        for (name, a), b in zip(ours_model.named_parameters(), ref_model.parameters()):
            assert torch.equal(a, b), (step, name)


def _oracle(a: np.ndarray, b: np.ndarray, w0: np.ndarray, delay: int, steps: int, lr: float, beta1: float,
            beta2: float, eps: float, wd: float) -> list[np.ndarray]:
    """The module docstring's update, by hand, in float64 (prod mu rounded to float32 as torch
    keeps it), on f(w) = 1/2 w^T A w - b^T w with the gradient taken ``delay`` updates late."""
    history = [w0.copy()]
    w, m, v, product = w0.copy(), np.zeros_like(w0), np.zeros_like(w0), np.float32(1.0)
    for t in range(1, steps + 1):
        stale = history[max(0, len(history) - 1 - delay)]
        g = a @ stale - b
        mu = beta1 * (1.0 - 0.5 * 0.96 ** (t * PSI))
        mu_next = beta1 * (1.0 - 0.5 * 0.96 ** ((t + 1) * PSI))
        product = np.float32(product * mu)
        w = w * (1 - lr * wd)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        d = np.sqrt(v / (1 - beta2**t)) + eps
        w = w - lr * (1 - mu) / (1 - float(product)) * g / d - lr * mu_next / (1 - float(product) * mu_next) * m / d
        history.append(w.copy())
    return history[1:]


@pytest.mark.parametrize("delay", [0, 1, 3])
def test_update_on_a_delayed_quadratic_equals_the_hand_computed_oracle(delay: int) -> None:
    """Fixed delay tau: step t's gradient is taken at the weights of step t - tau. The optimizer
    runs on float64 weights, so the only difference from the oracle is the order of float64
    operations: a few ulp per step, 1e-12 relative over 50 steps."""
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.standard_normal((6, 6)))
    a = q @ np.diag(np.logspace(0, 2, 6)) @ q.T
    b, w0 = rng.standard_normal(6), rng.standard_normal(6)
    lookahead = Lookahead(delay=delay, num_stages=4, momentum_decay=PSI)
    lr, beta2 = 0.02, 0.999
    beta1 = lookahead.beta1(0.9)
    want = _oracle(a, b, w0, delay, 50, lr, beta1, beta2, 1e-8, 0.1)
    w = torch.nn.Parameter(torch.tensor(w0.reshape(2, 3)))
    opt = DelayNesterovAdamW([("weight", w)], lr=lr, weight_decay=0.1, betas=(0.9, beta2), eps=1e-8,
                             lookahead=lookahead)
    history = [w.detach().clone()]
    for expected in want:
        stale = history[max(0, len(history) - 1 - delay)].reshape(-1).numpy()
        w.grad = torch.tensor(a @ stale - b).reshape(2, 3)
        opt.step(lr)
        history.append(w.detach().clone())
        got = w.detach().reshape(-1).numpy()
        assert np.abs(got - expected).max() <= 1e-12 * np.abs(expected).max(), (got, expected)
    assert not np.allclose(want[-1], want[0])


@pytest.mark.parametrize("schedule", ["paci", "async-1f1b", "pipedream-2bw", "pipemare", "amdp"])
def test_every_async_schedule_gives_each_stage_the_beta1_of_its_declared_delay(megatron_world1,
                                                                               schedule: str) -> None:
    from megatron.trainer.plan.parse import parse_run_plan

    argv = [*tiny_args(2, schedule, 4, 4), *SCHEDULE_FLAGS[schedule], "--optimizer", "delay-nesterov"]
    run = parse_run_plan(argv).run
    delays = run.schedule_cls.traits.policy_for(run.schedule).gradient_delays
    workers = emulate(argv)
    for w in workers:
        opt = w.setup.optimizer
        assert isinstance(opt, DelayNesterovAdamW) and opt.step_count == 4
        assert opt.betas[0] == 0.9 + delays[w.stage] * (0.99 - 0.9) / len(delays)
    assert all(torch.isfinite(v).all() for v in final_params(workers).values())


def test_async_1f1b_stages_look_further_ahead_the_staler_they_are(megatron_world1) -> None:
    """N = 4, a = 1: delays ceil((N-1-s)/1) = 3, 2, 1, 0."""
    workers = emulate([*tiny_args(4, "async-1f1b", 1, 2), "--optimizer", "delay-nesterov"])
    assert [w.setup.optimizer.lookahead.delay for w in workers] == [3, 2, 1, 0]
    betas = [w.setup.optimizer.betas[0] for w in workers]
    assert betas == sorted(betas, reverse=True) and betas[-1] == 0.9


LOOKAHEAD = ("--optimizer", "delay-nesterov")


def test_distributed_runtime_equals_emulator_with_the_lookahead(megatron_world1, tmp_path: Path) -> None:
    assert_runtime_equals_emulator([*tiny_args(2, "paci", 4, 6, "--hidden-dropout", "0.1"), *LOOKAHEAD],
                                   tmp_path / "dist")


def test_tiny_gpt_paci_resumes_bitwise(megatron_world1, tmp_path: Path) -> None:
    argv = [*tiny_args(2, "paci", 4, 12, "--hidden-dropout", "0.1", "--attention-dropout", "0.1"), *LOOKAHEAD]
    assert_emulated_resume_is_bitwise(argv, 12, 6, tmp_path)


def test_amdp_sharded_state_equals_replicated_bitwise(megatron_world1) -> None:
    """NAdam is element-wise: each replica stepping its range gives the whole's bits."""
    base = [*tiny_args(4, "amdp", 8, 3), "--num-layers", "4", *LOOKAHEAD]
    sharded = final_params(emulate([*base, "--amdp-optimizer-state", "sharded"]))
    replicated = final_params(emulate([*base, "--amdp-optimizer-state", "replicated"]))
    for name, value in replicated.items():
        assert torch.equal(sharded[name], value), name


@pytest.mark.parametrize("argv,fragment", [
    (["--optimizer", "delay-nesterov"], "--pipeline-schedule 1f1b declares none"),
    (["--optimizer", "delay-nesterov", "--pipeline-schedule", "zb-h1"], "--pipeline-schedule zb-h1 declares none"),
    (["--optimizer", "delay-nesterov", "--pipeline-schedule", "paci", "--lookahead-max-momentum", "0.5"],
     "is below --adam-beta1"),
    (["--optimizer", "delay-nesterov", "--pipeline-schedule", "paci", "--lookahead-max-momentum", "1.0"],
     "--lookahead-max-momentum must be in [0, 1)"),
    (["--optimizer", "nesterov"], "invalid choice"),
    (["--pipeline-schedule", "paci", "--nadam-momentum-decay", "0.01"], "--nadam-momentum-decay needs --optimizer"),
])
def test_bad_lookahead_flags_are_refused_in_one_line(capsys, argv: list[str], fragment: str) -> None:
    assert_flag_error(capsys, ["--mock-data", *argv], fragment)
