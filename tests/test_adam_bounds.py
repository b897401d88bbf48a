"""The derived tolerances of tests/adam_bounds.py: sound where they must hold, tight where they must bite.

Checked on the optimizer alone (no model, no processes): two AdamW runs whose gradients differ
by a controlled relative noise stay within the bound; a parameter moved by a fraction of one
step fails it; ``R_t`` is the maximum ratio any gradient sequence reaches.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.adam_bounds import assert_within_bounds, ratio_bound, trace_adam

pytestmark = pytest.mark.numerics  # re-run by .ci/run under a second ATEN_CPU_CAPABILITY

BETAS = (0.9, 0.999)


def test_ratio_bound_is_the_maximum_over_gradient_sequences():
    """R_1 = 1 exactly; for t = 2, 3 no sequence exceeds R_t, and the Cauchy-Schwarz optimum
    ``g_j ∝ a_j / b_j`` reaches it."""
    assert ratio_bound(BETAS, 1) == pytest.approx(1.0, abs=1e-12)
    b1, b2 = BETAS
    gen = torch.Generator().manual_seed(0)
    for t in (2, 3):
        a = torch.tensor([(1 - b1) * b1 ** (t - j) for j in range(1, t + 1)], dtype=torch.float64)
        b = torch.tensor([(1 - b2) * b2 ** (t - j) for j in range(1, t + 1)], dtype=torch.float64)

        def ratio(g: torch.Tensor) -> torch.Tensor:
            mhat = (a * g).sum(-1) / (1 - b1 ** t)
            vhat = (b * g * g).sum(-1) / (1 - b2 ** t)
            return mhat.abs() / vhat.sqrt()

        random = torch.randn(100_000, t, generator=gen, dtype=torch.float64)
        assert float(ratio(random).max()) <= ratio_bound(BETAS, t) * (1 + 1e-12)
        assert float(ratio(a / b)) == pytest.approx(ratio_bound(BETAS, t), rel=1e-12)


def _train(grads: list[torch.Tensor], init: torch.Tensor, lr: float) -> torch.nn.Parameter:
    from megatron.trainer.optim.adamw import StageAdamW

    p = torch.nn.Parameter(init.clone())
    opt = StageAdamW([("w", p)], lr=lr, weight_decay=0.01, betas=BETAS, eps=1e-8)
    for g in grads:
        p.grad = g.clone()
        opt.step(lr)
    return p


def test_runs_with_noisy_gradients_stay_within_and_a_moved_element_fails():
    """Gradients with a resolved part and elements near zero (the case Adam amplifies), perturbed
    by relative noise ``rho`` of the tensor's largest gradient: the perturbed run's parameters
    stay within the bound derived from the clean run's steps, the near-zero elements use the
    ``2 R lr`` allowance, the typical resolved one a bound far below one step, and an element moved by a
    tenth of one step fails."""
    gen = torch.Generator().manual_seed(1)
    lr, rho, n = 1e-3, 1e-5, 4096
    init = torch.randn(n, generator=gen) * 0.02
    clean = [torch.randn(n, generator=gen) for _ in range(3)]
    for g in clean:
        g[:64] *= 1e-7  # below the noise: Adam picks the step's sign from rounding
    scale = max(float(g.abs().max()) for g in clean)
    noisy = [g + rho * scale * (2 * torch.rand(n, generator=gen) - 1) for g in clean]

    with trace_adam() as trace:
        reference = _train(clean, init, lr)
    ours = _train(noisy, init, lr).detach()
    bound = trace.bound(reference, rho)
    worst = assert_within_bounds({"w": ours}, {"w": reference.detach()}, {"w": bound})
    assert 0.05 < worst <= 1.0
    assert float((ours - reference)[:64].abs().max()) > 0.1 * lr  # the noise really flipped steps
    assert float(bound[64:].median()) < 0.01 * lr  # resolved elements: held far below one step

    moved = ours.clone()
    moved[100] += 0.1 * lr
    with pytest.raises(AssertionError, match="1 of 4096 elements beyond the derived bound"):
        assert_within_bounds({"w": moved}, {"w": reference.detach()}, {"w": bound})


def test_the_trace_refuses_a_sharded_reference():
    from megatron.trainer.optim.adamw import StageAdamW

    p = torch.nn.Parameter(torch.zeros(8))
    opt = StageAdamW([("w", p)], lr=1e-3, weight_decay=0.0, shards={"w": (0, 4)})
    p.grad = torch.ones(8)
    with trace_adam(), pytest.raises(AssertionError, match="must not shard"):
        opt.step(1e-3)
    assert math.isfinite(float(p.sum()))
