"""Tests for the stage-local AdamW (megatron.trainer.optim.adamw) and LRSchedule.

The reference for the optimizer is torch.optim.AdamW(foreach=False); the
reference for the schedule is megatron-core's OptimizerParamScheduler.
"""

from __future__ import annotations

import copy
import inspect
import io
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron.trainer.optim import adamw as optimizer_module
from megatron.trainer.optim.lr_schedule import LRSchedule
from megatron.trainer.optim.adamw import StageAdamW

BETAS = (0.9, 0.95)
EPS = 1e-8
WD = 0.1
LRS = [1e-2, 3e-3, 7e-3, 5e-4, 2e-2, 1e-3]


def make_model(seed: int = 0) -> nn.Module:
    """Linear + LayerNorm + Linear: 2-D weights (decayed), biases and a norm scale (not)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


def batch(step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A deterministic input per step, so that two runs see identical data."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(5, 4, generator=gen).to(dtype)


def backward(model: nn.Module, step: int) -> None:
    """One forward/backward on the step's batch (grads accumulate into .grad)."""
    dtype = next(model.parameters()).dtype
    model(batch(step, dtype)).float().square().mean().backward()


def stage_opt(model: nn.Module) -> StageAdamW:
    return StageAdamW(list(model.named_parameters()), lr=LRS[0], weight_decay=WD, betas=BETAS, eps=EPS)


def torch_opt(model: nn.Module) -> torch.optim.AdamW:
    """torch AdamW with Megatron's decay / no-decay groups."""
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or p.ndim == 1)]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or p.ndim == 1]
    groups = [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LRS[0], betas=BETAS, eps=EPS, foreach=False)


def assert_params_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def run_stage(model: nn.Module, opt: StageAdamW, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        backward(model, step)
        opt.step(LRS[step])


# --------------------------------------------------------------- AdamW parity


def test_no_decay_groups_follow_megatron_convention() -> None:
    opt = stage_opt(make_model())
    assert opt.no_decay_names == {"0.bias", "1.weight", "1.bias", "3.bias"}


def test_matches_torch_adamw_bitwise() -> None:
    ours_model, ref_model = make_model(), make_model()
    ours, ref = stage_opt(ours_model), torch_opt(ref_model)
    for step in range(5):
        ours.zero_grad()
        ref.zero_grad()
        backward(ours_model, step)
        backward(ref_model, step)
        for group in ref.param_groups:
            group["lr"] = LRS[step]
        ours.step(LRS[step])
        ref.step()
        assert_params_equal(ours_model, ref_model)
    assert ours.step_count == 5
    saved = ours.state_dict()["params"]
    for (name, _), p_ref in zip(ours.named_parameters(), ref_model.parameters()):
        assert torch.equal(saved[name]["exp_avg"], ref.state[p_ref]["exp_avg"])
        assert torch.equal(saved[name]["exp_avg_sq"], ref.state[p_ref]["exp_avg_sq"])


def test_grad_scale_equals_prescaled_grads() -> None:
    """step(lr, grad_scale=c) == torch AdamW on grads multiplied by c, and p.grad is untouched."""
    ours_model, ref_model = make_model(), make_model()
    ours, ref = stage_opt(ours_model), torch_opt(ref_model)
    coef = 0.37
    for step in range(3):
        ours.zero_grad()
        ref.zero_grad()
        backward(ours_model, step)
        backward(ref_model, step)
        grads_before = [p.grad.clone() for p in ours.parameters()]
        for p in ref_model.parameters():
            p.grad.mul_(coef)
        ours.step(LRS[0], grad_scale=coef)
        ref.step()
        assert_params_equal(ours_model, ref_model)
        assert all(torch.equal(g, p.grad) for g, p in zip(grads_before, ours.parameters()))


# ----------------------------------------------------------- version counter


def two_layer() -> tuple[nn.Module, torch.Tensor]:
    """Linear-tanh-Linear whose backward needs the saved weights (input requires grad)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(6, 3, requires_grad=True)
    return model, x


def test_step_between_forward_and_backward_keeps_autograd_valid() -> None:
    model, x = two_layer()
    opt = StageAdamW(list(model.named_parameters()), lr=0.1, weight_decay=WD)
    model(x).square().sum().backward()  # micro-batch 1: gives the update its grads
    loss = model(x).square().sum()  # micro-batch 2: forward in flight
    before = [p.detach().clone() for p in model.parameters()]
    versions = [p._version for p in model.parameters()]
    opt.step(0.1)
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert [p._version for p in model.parameters()] == versions
    loss.backward()  # must not raise


def test_naive_no_grad_inplace_update_would_raise() -> None:
    """Control: the usual in-place update under no_grad breaks the in-flight backward."""
    model, x = two_layer()
    loss = model(x).square().sum()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_inflight_backward_reads_updated_weights() -> None:
    """Documents the async-pipeline semantics: the saved weight *is* the updated storage."""
    lin = nn.Linear(3, 2, bias=False)
    x = torch.randn(4, 3, requires_grad=True)
    y = lin(x)
    lin.weight.grad = torch.randn_like(lin.weight)
    StageAdamW(list(lin.named_parameters()), lr=0.5, weight_decay=0.0).step(0.5)
    y.sum().backward()
    assert torch.allclose(x.grad, torch.ones(4, 2) @ lin.weight.detach())


def test_module_has_no_cuda_calls() -> None:
    assert "torch.cuda" not in inspect.getsource(optimizer_module)
    assert ".cuda(" not in inspect.getsource(optimizer_module)


# ------------------------------------------------------ clipping and checks


def test_clip_coef() -> None:
    assert StageAdamW.clip_coef(2.0, 1.0) == 1.0 / (2.0 + 1e-6)
    assert StageAdamW.clip_coef(0.5, 1.0) == 1.0
    assert StageAdamW.clip_coef(0.0, 1.0) == 1.0
    assert StageAdamW.clip_coef(1.0, 1.0) < 1.0  # the 1e-6 tips an exact match below 1
    with pytest.raises(ValueError):
        StageAdamW.clip_coef(1.0, 0.0)


def test_grad_sq_norm_counts_none_as_zero() -> None:
    model = make_model()
    opt = stage_opt(model)
    assert opt.grad_sq_norm().item() == 0.0
    params = opt.parameters()
    params[0].grad = torch.full_like(params[0], 2.0)
    params[1].grad = torch.full_like(params[1], -1.0)
    norm = opt.grad_sq_norm()
    assert norm.dtype == torch.float32 and norm.ndim == 0 and norm.device == params[0].device
    assert norm.item() == 4.0 * params[0].numel() + params[1].numel()


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_grads_finite(bad: float) -> None:
    model = make_model()
    opt = stage_opt(model)
    assert opt.grads_finite()  # all grads None
    backward(model, 0)
    assert opt.grads_finite()
    opt.parameters()[2].grad[0] = bad
    assert not opt.grads_finite()


def test_zero_grad_drops_grads_and_the_next_window_matches_in_place_zeroing() -> None:
    """zero_grad sets every grad to None (the next backward assigns instead of adding to
    zeros), and a window accumulated after it has the bits of one accumulated into zeroed
    buffers."""
    model = make_model()
    opt = stage_opt(model)
    backward(model, 0)
    opt.zero_grad()
    assert all(p.grad is None for p in opt.parameters())
    backward(model, 0)
    backward(model, 1)
    dropped = [p.grad.clone() for p in opt.parameters()]
    for p in opt.parameters():
        p.grad.zero_()
    backward(model, 0)
    backward(model, 1)
    assert all(torch.equal(p.grad, d) for p, d in zip(opt.parameters(), dropped))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_sq_norm_matches_a_float64_sum(dtype: torch.dtype) -> None:
    """The fused per-tensor dot product is as accurate as squaring and summing in fp32, against
    a float64 reference; bf16 grads are squared in fp32 (their squares would lose bits)."""
    model = make_model().to(dtype)
    opt = stage_opt(model)
    backward(model, 0)
    exact = sum(float(p.grad.double().square().sum()) for p in opt.parameters())
    norm = opt.grad_sq_norm()
    assert norm.dtype == torch.float32 and float(norm) == pytest.approx(exact, rel=1e-6)


def test_step_rejects_bad_arguments() -> None:
    opt = stage_opt(make_model())
    with pytest.raises(ValueError):
        opt.step(float("nan"))
    with pytest.raises(ValueError):
        opt.step(1e-3, grad_scale=float("inf"))
    with pytest.raises(ValueError):
        StageAdamW([("w", nn.Parameter(torch.ones(2, 2)))] * 2, lr=1e-3, weight_decay=0.0)


# --------------------------------------------------------- bf16 master weights


def test_bf16_params_keep_fp32_master() -> None:
    """Masters are fp32, params are the masters cast to bf16, and the masters follow
    exactly the fp32 torch AdamW fed the same (bf16) gradients."""
    model = make_model().to(torch.bfloat16)
    ref_model = make_model().to(torch.bfloat16).float()  # fp32 copy of the bf16 values
    opt, ref = stage_opt(model), torch_opt(ref_model)
    for step in range(4):
        opt.zero_grad()
        backward(model, step)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            q.grad = p.grad.float()
        for group in ref.param_groups:
            group["lr"] = LRS[step]
        opt.step(LRS[step])
        ref.step()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            master = opt.master_weight(name)
            assert p.dtype == torch.bfloat16 and master.dtype == torch.float32
            assert torch.equal(p, master.to(torch.bfloat16)), name
            assert torch.equal(master, q), name
    assert all(e.dtype == torch.float32 for s in opt.state_dict()["params"].values() for e in s.values())


# ------------------------------------------------------------- checkpointing


def roundtrip(obj: dict) -> dict:
    """Serialize like a real checkpoint does."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_resume_is_bitwise_identical(dtype: torch.dtype) -> None:
    straight = make_model().to(dtype)
    straight_opt = stage_opt(straight)
    run_stage(straight, straight_opt, range(6))

    first = make_model().to(dtype)
    first_opt = stage_opt(first)
    run_stage(first, first_opt, range(3))
    model_sd, opt_sd = roundtrip(first.state_dict()), roundtrip(first_opt.state_dict())
    snapshot = copy.deepcopy(opt_sd)
    run_stage(first, first_opt, range(3, 4))  # training on must not touch the saved dict
    assert all(torch.equal(a, b) for n in opt_sd["params"] for a, b in zip(
        opt_sd["params"][n].values(), snapshot["params"][n].values()))

    resumed = make_model(seed=123).to(dtype)
    resumed.load_state_dict(model_sd)
    resumed_opt = stage_opt(resumed)
    resumed_opt.load_state_dict(opt_sd)
    assert resumed_opt.step_count == 3
    run_stage(resumed, resumed_opt, range(3, 6))
    assert_params_equal(resumed, straight)
    final, expected = resumed_opt.state_dict(), straight_opt.state_dict()
    assert final["step_count"] == expected["step_count"] == 6
    for name, entry in expected["params"].items():
        assert entry.keys() == final["params"][name].keys()
        assert all(torch.equal(entry[k], final["params"][name][k]) for k in entry)


def test_load_state_dict_rejects_mismatched_names() -> None:
    opt = stage_opt(make_model())
    sd = opt.state_dict()
    sd["params"]["extra"] = sd["params"].pop("0.weight")
    with pytest.raises(ValueError, match="missing"):
        opt.load_state_dict(sd)


# ------------------------------------------------------------------ LRSchedule


def test_warmup_ramp_and_calling_convention() -> None:
    s = LRSchedule(max_lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=10, decay_style="cosine")
    assert [s.lr(n) for n in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    # The trainer calls lr(step_count + 1): the very first update is not a zero-lr step.
    assert s.lr(0 + 1) == 0.25


def test_cosine_end_points() -> None:
    s = LRSchedule(max_lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=10, decay_style="cosine")
    assert s.lr(4) == 1.0
    assert 0.1 < s.lr(5) < 1.0
    assert s.lr(7) == pytest.approx(0.55)
    assert s.lr(10) == pytest.approx(0.1, abs=1e-15)
    no_warmup = LRSchedule(max_lr=2.0, min_lr=0.0, warmup_steps=0, decay_steps=8, decay_style="cosine")
    assert no_warmup.lr(0) == 2.0 and no_warmup.lr(8) == 0.0


def test_min_lr_after_decay() -> None:
    for style in ("linear", "cosine", "inverse-square-root"):
        s = LRSchedule(max_lr=1.0, min_lr=0.05, warmup_steps=2, decay_steps=10, decay_style=style)
        assert s.lr(11) == 0.05 and s.lr(10_000) == 0.05


def test_constant() -> None:
    s = LRSchedule(max_lr=3e-4, min_lr=0.0, warmup_steps=2, decay_steps=5, decay_style="constant")
    assert s.lr(1) == 1.5e-4
    assert all(s.lr(n) == 3e-4 for n in (2, 3, 5, 6, 100))


def test_linear() -> None:
    s = LRSchedule(max_lr=1.0, min_lr=0.0, warmup_steps=2, decay_steps=12, decay_style="linear")
    assert s.lr(2) == 1.0
    assert s.lr(7) == pytest.approx(0.5)
    assert s.lr(12) == 0.0


def test_inverse_square_root_and_wsd() -> None:
    isr = LRSchedule(max_lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=100, decay_style="inverse-square-root")
    assert isr.lr(16) == pytest.approx(0.5)
    assert isr.lr(99) == pytest.approx(0.2010, abs=1e-4)
    wsd = LRSchedule(max_lr=1.0, min_lr=0.0, warmup_steps=2, decay_steps=10, decay_style="WSD", wsd_decay_steps=4)
    assert [wsd.lr(n) for n in (3, 6)] == [1.0, 1.0]
    assert wsd.lr(8) == pytest.approx(0.5) and wsd.lr(10) == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_lr=0.1, min_lr=0.2, warmup_steps=1, decay_steps=10, decay_style="cosine"),
        dict(max_lr=0.1, min_lr=0.0, warmup_steps=11, decay_steps=10, decay_style="cosine"),
        dict(max_lr=0.1, min_lr=0.0, warmup_steps=-1, decay_steps=10, decay_style="cosine"),
        dict(max_lr=0.1, min_lr=0.0, warmup_steps=0, decay_steps=0, decay_style="linear"),
        dict(max_lr=0.1, min_lr=-0.1, warmup_steps=0, decay_steps=10, decay_style="linear"),
        dict(max_lr=0.1, min_lr=0.0, warmup_steps=0, decay_steps=10, decay_style="exp"),
        dict(max_lr=0.1, min_lr=0.0, warmup_steps=0, decay_steps=10, decay_style="WSD"),
    ],
)
def test_bad_args(kwargs: dict) -> None:
    with pytest.raises(ValueError) as info:
        LRSchedule(**kwargs)
    assert "\n" not in str(info.value)


def test_negative_step_rejected() -> None:
    s = LRSchedule(max_lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=5, decay_style="linear")
    with pytest.raises(ValueError):
        s.lr(-1)


@pytest.mark.parametrize(
    "style,extra",
    [("constant", {}), ("linear", {}), ("cosine", {}), ("inverse-square-root", {}),
     ("WSD", {"wsd_decay_steps": 7, "wsd_decay_style": "cosine"}),
     ("WSD", {"wsd_decay_steps": 5, "wsd_decay_style": "minus_sqrt"})],
)
def test_matches_megatron_scheduler(style: str, extra: dict) -> None:
    """lr(n) equals megatron-core's get_lr with num_steps == n, for every n."""
    sched_mod = pytest.importorskip("megatron.core.optimizer_param_scheduler")
    ours = LRSchedule(max_lr=3e-4, min_lr=3e-5, warmup_steps=5, decay_steps=20, decay_style=style, **extra)
    theirs = sched_mod.OptimizerParamScheduler(
        SimpleNamespace(param_groups=[{}]), init_lr=0.0, max_lr=3e-4, min_lr=3e-5,
        lr_warmup_steps=5, lr_decay_steps=20, lr_decay_style=style, start_wd=0.1, end_wd=0.1,
        wd_incr_steps=20, wd_incr_style="constant", wsd_decay_steps=extra.get("wsd_decay_steps"),
        lr_wsd_decay_style=extra.get("wsd_decay_style"),
    )
    for n in range(0, 26):
        theirs.num_steps = n
        assert ours.lr(n) == theirs.get_lr({}), n
