"""StageAdamW.rollback: Zero Bubble's in-place AdamW rollback (Appendix C) and the exact mode.

In-place rollback inverts the step arithmetically, so it is held to 1e-6 of each tensor's
scale (it divides by beta1, beta2 and 1 - lr * wd and subtracts nearly equal numbers); the
exact mode restores a backup and is held to bitwise equality.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron.trainer.optim.adamw import StageAdamW

BETAS = (0.9, 0.95)
WD = 0.1
LRS = [1e-2, 3e-3, 7e-3, 5e-4, 2e-2, 1e-3, 4e-3, 8e-3]
RTOL = 1e-6


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def grads_for(model: nn.Module, step: int) -> None:
    """Fresh gradients of the step's deterministic batch (previous grads zeroed)."""
    for p in model.parameters():
        p.grad = None
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(5, 4, generator=gen).to(next(model.parameters()).dtype)
    model(x).float().square().mean().backward()


def opt_for(model: nn.Module, exact: bool = False) -> StageAdamW:
    return StageAdamW(list(model.named_parameters()), lr=LRS[0], weight_decay=WD, betas=BETAS, eps=1e-8, exact=exact)


def snapshot(model: nn.Module, opt: StageAdamW) -> dict[str, torch.Tensor]:
    """Weights (fp32 master where there is one), both moments, and the model's params."""
    sd = opt.state_dict()
    out = {"step_count": torch.tensor(sd["step_count"])}
    for name, p in model.named_parameters():
        out[f"{name}.param"] = p.detach().clone()
        out[f"{name}.theta"] = opt.master_weight(name).detach().clone()
        out[f"{name}.m"] = sd["params"][name]["exp_avg"]
        out[f"{name}.v"] = sd["params"][name]["exp_avg_sq"]
    return out


def assert_close(
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    rtol: float,
    skip_params: bool = False,
    stepped: dict[str, torch.Tensor] | None = None,
) -> None:
    """Equal within ``rtol`` of each tensor's scale: its max |value|, before or (given
    ``stepped``) after the step, so a tensor that was 0 (fresh moments, a zero-init bias)
    is held to the size of what the step put there."""
    assert got.keys() == want.keys()
    for key, expected in want.items():
        if skip_params and key.endswith(".param"):
            continue
        actual = got[key]
        if rtol == 0.0:
            assert torch.equal(actual, expected), key
            continue
        scale = expected.abs().max().item()
        if stepped is not None:
            scale = max(scale, stepped[key].abs().max().item())
        err = (actual.float() - expected.float()).abs().max().item()
        assert err <= rtol * scale + 1e-12, f"{key}: max error {err:.3e} vs scale {scale:.3e}"


def warmed_up(exact: bool = False, dtype: torch.dtype = torch.float32, steps: int = 3) -> tuple[nn.Module, StageAdamW]:
    """A model and optimizer after ``steps`` steps, so the moments are not zero."""
    model = make_model(dtype=dtype)
    opt = opt_for(model, exact)
    for step in range(steps):
        grads_for(model, step)
        opt.step(LRS[step])
    return model, opt


def test_rollback_restores_params_and_moments_fp32() -> None:
    model, opt = warmed_up()
    grads_for(model, 3)
    before = snapshot(model, opt)
    opt.step(LRS[3])
    moved = snapshot(model, opt)
    assert any(not torch.equal(moved[k], before[k]) for k in before if k.endswith(".theta"))
    opt.rollback(LRS[3])
    assert opt.step_count == 3
    assert_close(snapshot(model, opt), before, RTOL)


def test_rollback_over_several_steps_with_weight_decay_and_clipping() -> None:
    """Step, roll back, check, then take the step for real; repeated from fresh (zero)
    moments on, with decay on the 2-D weights and a clip factor on some steps."""
    model = make_model()
    opt = opt_for(model)
    assert opt.weight_decay == WD and opt.no_decay_names  # decayed and undecayed params
    for step, lr in enumerate(LRS):
        grads_for(model, step)
        scale = 0.37 if step % 3 == 1 else 1.0
        before = snapshot(model, opt)
        opt.step(lr, grad_scale=scale)
        stepped = snapshot(model, opt)
        opt.rollback(lr, grad_scale=scale)
        assert_close(snapshot(model, opt), before, RTOL, stepped=stepped)
        opt.step(lr, grad_scale=scale)


def test_rollback_bf16_params_restores_fp32_master_and_recopies_params() -> None:
    model, opt = warmed_up(dtype=torch.bfloat16)
    assert opt.master_weight("0.weight").dtype == torch.float32
    grads_for(model, 3)
    before = snapshot(model, opt)
    opt.step(LRS[3])
    opt.rollback(LRS[3])
    after = snapshot(model, opt)
    assert_close(after, before, RTOL, skip_params=True)
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.detach(), opt.master_weight(name).to(torch.bfloat16)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_mode_restores_bitwise(dtype: torch.dtype) -> None:
    model, opt = warmed_up(exact=True, dtype=dtype)
    for step in (3, 4):
        grads_for(model, step)
        before = snapshot(model, opt)
        opt.step(LRS[step], grad_scale=0.5)
        opt.rollback(LRS[step], grad_scale=0.5)
        assert_close(snapshot(model, opt), before, 0.0)
        opt.step(LRS[step])


@pytest.mark.parametrize("exact", [False, True])
def test_redo_after_rollback_equals_clipped_step_from_the_start(exact: bool) -> None:
    """Post-validation's redo path: optimistic unclipped step, rollback, clipped step."""
    redo_model, redo = warmed_up(exact=exact)
    ref_model, ref = warmed_up(exact=exact)
    for step in (3, 4, 5):
        coef = 0.25 + 0.2 * (step - 3)
        for model in (redo_model, ref_model):
            grads_for(model, step)
        redo.step(LRS[step])
        redo.rollback(LRS[step])
        redo.step(LRS[step], grad_scale=coef)
        ref.step(LRS[step], grad_scale=coef)
        assert_close(snapshot(redo_model, redo), snapshot(ref_model, ref), 0.0 if exact else RTOL)


def test_rollback_refuses_what_it_cannot_invert() -> None:
    with pytest.raises(RuntimeError, match="no step to roll back"):
        opt_for(make_model()).rollback(LRS[0])
    model, opt = warmed_up()
    grads_for(model, 3)
    opt.step(LRS[3], grad_scale=0.5)
    with pytest.raises(ValueError, match="last step used"):
        opt.rollback(LRS[3])  # wrong grad_scale
    opt.rollback(LRS[3], grad_scale=0.5)
    with pytest.raises(RuntimeError, match="no step to roll back"):
        opt.rollback(LRS[3], grad_scale=0.5)  # only the most recent step, once
