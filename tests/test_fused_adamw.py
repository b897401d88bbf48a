"""``StageAdamW(fused=True)``: torch's fused AdamW kernel, the same bits whatever the sharding.

References: ``torch.optim.AdamW(fused=True)`` (bitwise, on tensors of a multiple of 64
elements, where the kernel has no scalar tail) and the single-tensor arithmetic (to within
rounding). The sharding test has a control: with the tail staging switched off
(``ALIGN = 1``) the same comparison must fail, so it can.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import megatron.trainer.optim.fused_adamw as fused_module
from megatron.trainer.optim.adamw import StageAdamW
from megatron.trainer.optim.basis_rotation import BasisRotationAdamW

LR, WD, BETAS, EPS = 1e-3, 0.1, (0.9, 0.999), 1e-8
ODD_SHAPES = [(61, 37), (1037,), (300, 7), (45,)]  # numels with scalar tails on every vector width


def make_params(shapes: list[tuple[int, ...]], seed: int = 1) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def set_grads(params: list[nn.Parameter], k: int) -> None:
    gen = torch.Generator().manual_seed(100 + k)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def named(params: list[nn.Parameter]) -> list[tuple[str, nn.Parameter]]:
    return [(f"w{i}" if p.ndim > 1 else f"b{i}.bias", p) for i, p in enumerate(params)]


def cut_points(n: int, parts: int) -> list[int]:
    """``parts`` ranges of ``n`` elements, boundaries at odd offsets (none a multiple of 8)."""
    step = n // parts
    return [0, *(k * step + 3 for k in range(1, parts)), n]


def sharded_vs_whole(shapes: list[tuple[int, ...]], parts: int, steps: int) -> tuple[bool, bool]:
    """Step one whole optimizer and ``parts`` sharded ones (one per range, as ZeRO replicas
    would); return (params equal, exp_avg_sq equal) over every element, bitwise."""
    whole_params = make_params(shapes)
    whole = StageAdamW(named(whole_params), lr=LR, weight_decay=WD, fused=True)
    replicas = []
    for r in range(parts):
        params = make_params(shapes)
        shards = {name: (cut_points(p.numel(), parts)[r], cut_points(p.numel(), parts)[r + 1])
                  for name, p in named(params)}
        replicas.append((params, StageAdamW(named(params), lr=LR, weight_decay=WD, fused=True, shards=shards)))
    for k in range(steps):
        set_grads(whole_params, k)
        whole.step(LR, grad_scale=0.7)
        for params, opt in replicas:
            set_grads(params, k)
            opt.step(LR, grad_scale=0.7)
    params_equal = state_equal = True
    for i, (name, p) in enumerate(named(whole_params)):
        cuts = cut_points(p.numel(), parts)
        merged = torch.cat([replicas[r][0][i].detach().view(-1)[cuts[r]:cuts[r + 1]] for r in range(parts)])
        params_equal &= torch.equal(merged, p.detach().view(-1))
        v = torch.cat([next(s.exp_avg_sq for s in replicas[r][1]._slots if s.name == name) for r in range(parts)])
        state_equal &= torch.equal(v, next(s.exp_avg_sq for s in whole._slots if s.name == name).view(-1))
    return params_equal, state_equal


def test_fused_step_gives_a_shard_the_bits_of_the_whole_parameter() -> None:
    assert sharded_vs_whole(ODD_SHAPES, parts=5, steps=4) == (True, True)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() == "DEFAULT",
                    reason="ATen's DEFAULT kernels have no vector body: every element takes the scalar path, "
                           "so there is no tail to round differently and the control cannot differ")
def test_without_tail_staging_sharding_changes_the_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the kernel's own scalar tails round ``exp_avg_sq`` differently from its
    vector body (on a CPU capability with vectors)."""
    monkeypatch.setattr(fused_module, "ALIGN", 1)
    assert sharded_vs_whole(ODD_SHAPES, parts=5, steps=4)[1] is False


@pytest.mark.parametrize("threads", [2, 3])
def test_fused_step_does_not_depend_on_the_thread_count(threads: int) -> None:
    results = []
    before = torch.get_num_threads()
    try:
        for n in (1, threads):
            torch.set_num_threads(n)
            params = make_params([(4099, 33), (70001,)])
            opt = StageAdamW(named(params), lr=LR, weight_decay=WD, fused=True)
            for k in range(3):
                set_grads(params, k)
                opt.step(LR)
            results.append([p.detach().clone() for p in params])
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_fused_equals_torch_fused_adamw_bitwise_on_aligned_tensors() -> None:
    """Decay and no-decay groups, clipping (the kernel's own gradient scaling: divided by the
    float32 reciprocal of the clip coefficient, as ``torch.amp``'s unscaling does)."""
    shapes = [(64, 32), (128,), (256, 4)]
    ours_params, ref_params = make_params(shapes), make_params(shapes)
    ours = StageAdamW(named(ours_params), lr=LR, weight_decay=WD, fused=True)
    decay = [p for n, p in named(ref_params) if not n.endswith("bias")]
    no_decay = [p for n, p in named(ref_params) if n.endswith("bias")]
    assert decay and no_decay
    ref = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS, fused=True)
    for k, (lr, coef) in enumerate([(LR, 1.0), (2 * LR, 0.5), (LR / 2, 0.3)]):
        set_grads(ours_params, k)
        set_grads(ref_params, k)
        ours.step(lr, grad_scale=coef)
        for p in ref_params:
            p.grad.div_(torch.tensor(1.0 / coef, dtype=torch.float32))
        for g in ref.param_groups:
            g["lr"] = lr
        ref.step()
    for a, b in zip(ours_params, ref_params):
        assert torch.equal(a, b)


def test_fused_matches_the_single_tensor_arithmetic_to_rounding() -> None:
    fused_params, plain_params = make_params(ODD_SHAPES), make_params(ODD_SHAPES)
    fused = StageAdamW(named(fused_params), lr=LR, weight_decay=WD, fused=True)
    plain = StageAdamW(named(plain_params), lr=LR, weight_decay=WD)
    for k in range(5):
        set_grads(fused_params, k)
        set_grads(plain_params, k)
        fused.step(LR, 0.9)
        plain.step(LR, 0.9)
    # Same gradients, the same Adam formula evaluated in another order (fused multiply-adds, the
    # clip factor as a reciprocal): each step's update differs by a few roundings of itself,
    # <= ~8 u lr R_t ~ 5e-10 (m, v, sqrt, division, scaling; |mhat/sqrt(vhat)| <= R_t ~ 1, see
    # tests/adam_bounds.py), and each step rounds p twice, 2 u |p|. Over 5 steps: <= 6e-7 |p| +
    # 2.4e-9, inside rtol 1e-6 and atol 1e-7 with margin, on any CPU's kernels.
    for a, b, start in zip(fused_params, plain_params, make_params(ODD_SHAPES)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert (a - start).abs().max() > 1e-3  # five steps of ~lr: far above the tolerance


def test_fused_bf16_parameters_step_their_fp32_masters() -> None:
    fused_params = [nn.Parameter(p.detach().to(torch.bfloat16)) for p in make_params(ODD_SHAPES)]
    plain_params = [nn.Parameter(p.detach().clone()) for p in fused_params]
    fused = StageAdamW(named(fused_params), lr=LR, weight_decay=WD, fused=True)
    plain = StageAdamW(named(plain_params), lr=LR, weight_decay=WD)
    for k in range(3):
        for params in (fused_params, plain_params):
            set_grads(params, k)
        fused.step(LR)
        plain.step(LR)
    for name, _ in named(fused_params):  # the fp32 masters: the bound of the test above, over 3 steps
        torch.testing.assert_close(fused.master_weight(name), plain.master_weight(name), rtol=1e-6, atol=1e-7)
    for a in fused_params:
        assert a.dtype == torch.bfloat16


def test_fused_exact_rollback_restores_every_bit() -> None:
    params = make_params(ODD_SHAPES)
    opt = StageAdamW(named(params), lr=LR, weight_decay=WD, fused=True, exact=True)
    set_grads(params, 0)
    opt.step(LR)
    before = [p.detach().clone() for p in params]
    set_grads(params, 1)
    opt.step(LR, 0.5)
    opt.rollback(LR, 0.5)
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    assert opt.step_count == 1


def test_fused_is_refused_for_an_optimizer_with_its_own_update() -> None:
    """The kernel would silently skip a subclass's update (basis rotation's rotated Adam)."""

    class OwnUpdate(StageAdamW):
        _adam_update = BasisRotationAdamW._adam_update

    with pytest.raises(ValueError, match="fused=True runs plain Adam"):
        OwnUpdate(named(make_params([(8, 8)])), lr=LR, weight_decay=WD, fused=True)


def test_adam_kernel_flag_resolves_and_refuses() -> None:
    from megatron.trainer.plan.parse import parse_args
    from megatron.trainer.plan.build import build_run_plan
    from megatron.trainer.optim.registry import build_optimizer

    args = parse_args(["--mock-data"])
    assert args.adam_kernel == "fused"
    config = build_run_plan(args)
    assert config.optimizer.adam_kernel == "fused"
    assert build_optimizer(config, named(make_params([(8, 8)])), 0).fused
    assert parse_args(["--mock-data", "--adam-kernel", "single-tensor"]).adam_kernel == "single-tensor"
    assert parse_args(["--mock-data", "--optimizer", "basis-rotation"]).adam_kernel == "single-tensor"
    with pytest.raises(SystemExit):
        parse_args(["--mock-data", "--optimizer", "basis-rotation", "--adam-kernel", "fused"])


def test_disposable_grads_give_the_same_bits_and_kept_grads_stay_untouched() -> None:
    """The runtime's OPT lets the kernel scale gradients in place (it zeroes them next); any
    other caller (post-validation's step, which may roll back) keeps them as they were."""
    results = []
    for disposable in (False, True):
        params = make_params(ODD_SHAPES)
        opt = StageAdamW(named(params), lr=LR, weight_decay=WD, fused=True)
        set_grads(params, 0)
        grads = [p.grad.clone() for p in params]
        opt.step(LR, grad_scale=0.25, grads_disposable=disposable)
        kept = all(torch.equal(p.grad, g) for p, g in zip(params, grads))
        assert kept is not disposable
        results.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*results))
