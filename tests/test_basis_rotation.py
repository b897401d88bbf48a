"""Tests for ``--optimizer basis-rotation`` (megatron.trainer.optim.basis_rotation).

Identity basis == AdamW bitwise; bases stay orthogonal; the second moment is carried into a
new basis by the documented formula (checked against an explicit Kronecker computation);
bilateral rotation beats AdamW on a rotated ill-conditioned quadratic under delay; the
stage-aware budget equals the uniform one; a tiny GPT trains under PACI and resumes bitwise.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from async_helpers import emulate, final_params, tiny_args
from test_checkpoint_resume import SCHEDULE_FLAGS, _losses
from test_optimizer import (
    BETAS,
    EPS,
    LRS,
    WD,
    assert_params_equal,
    backward,
    make_model,
    torch_opt,
)
from torch import Tensor, nn

from megatron.trainer.checkpointing import checkpoint as ckpt
from megatron.trainer.plan.parse import parse_args
from megatron.trainer.optim.basis_rotation import (
    BasisRotationAdamW,
    RotationConfig,
    carry_second_moment,
    refresh_rate,
    refreshes_at,
)
from megatron.trainer.optim.adamw import StageAdamW


def rotation_opt(model: nn.Module, **config) -> BasisRotationAdamW:
    return BasisRotationAdamW(list(model.named_parameters()), lr=LRS[0], weight_decay=WD, betas=BETAS, eps=EPS,
                              rotation=RotationConfig(**config))


# ------------------------------------------------------------- identity basis


@pytest.mark.parametrize("geometry", ["bilateral", "unilateral"])
def test_identity_basis_equals_adamw_bitwise(geometry: str) -> None:
    ours_model, stage_model, ref_model = make_model(), make_model(), make_model()
    ours = rotation_opt(ours_model, geometry=geometry, refresh_interval=0)
    stage = StageAdamW(list(stage_model.named_parameters()), lr=LRS[0], weight_decay=WD, betas=BETAS, eps=EPS)
    ref = torch_opt(ref_model)
    assert ours.rotated_names == {"0.weight", "3.weight"}
    for step in range(6):
        for model, opt in ((ours_model, ours), (stage_model, stage), (ref_model, ref)):
            opt.zero_grad()
            backward(model, step)
        for group in ref.param_groups:
            group["lr"] = LRS[step]
        ours.step(LRS[step], grad_scale=0.5 if step == 3 else 1.0)
        stage.step(LRS[step], grad_scale=0.5 if step == 3 else 1.0)
        if step == 3:
            for p in ref_model.parameters():
                p.grad.mul_(0.5)
        ref.step()
        assert_params_equal(ours_model, stage_model)
        assert_params_equal(ours_model, ref_model)
    assert all(u is None and v is None for u, v in map(ours.basis, ours.rotated_names))


# --------------------------------------------------------------- orthogonality


@pytest.mark.parametrize("source", ["second-moment", "momentum"])
@pytest.mark.parametrize("geometry", ["bilateral", "unilateral"])
def test_bases_stay_orthogonal_over_many_refreshes(source: str, geometry: str) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(12, 20)  # like fc1 [ffn, h]: rows 20, columns 12
    opt = BasisRotationAdamW(list(layer.named_parameters()), lr=1e-2, weight_decay=0.0,
                             rotation=RotationConfig(geometry=geometry, source=source, refresh_interval=1))
    for step in range(200):
        layer.weight.grad = torch.randn(20, 12) * (1 + step % 7)
        layer.bias.grad = torch.randn(20)
        opt.step(1e-2)
    u, v = opt.basis("weight")
    if geometry == "bilateral":
        assert u is not None and v is not None
    else:  # the smaller side only: columns (12 < 20)
        assert u is None and v is not None
    for basis in (u, v):
        if basis is not None:
            eye = torch.eye(basis.shape[0])
            assert torch.allclose(basis.T @ basis, eye, atol=1e-5)
            assert torch.allclose(basis @ basis.T, eye, atol=1e-5)
    assert torch.isfinite(layer.weight).all()


def test_megatron_core_shapes_rotate_the_documented_sides() -> None:
    h, ffn = 16, 64
    named = [("decoder.layers.0.self_attention.linear_qkv.weight", nn.Parameter(torch.randn(3 * h, h))),
             ("decoder.layers.0.mlp.linear_fc1.weight", nn.Parameter(torch.randn(ffn, h))),
             ("decoder.layers.0.mlp.linear_fc2.weight", nn.Parameter(torch.randn(h, ffn))),
             ("embedding.word_embeddings.weight", nn.Parameter(torch.randn(32, h))),
             ("output_layer.weight", nn.Parameter(torch.randn(32, h))),  # untied: rows are tokens too
             ("decoder.layers.0.mlp.linear_fc1.bias", nn.Parameter(torch.randn(ffn)))]
    for geometry in ("bilateral", "unilateral"):
        opt = BasisRotationAdamW(named, lr=1e-3, weight_decay=0.0,
                                 rotation=RotationConfig(geometry=geometry, refresh_interval=1))
        assert opt.rotated_names == {n for n, _ in named[:3]}
        for _, p in named:
            p.grad = torch.randn_like(p)
        opt.step(1e-3)
        for name, p in named[:3]:
            u, v = opt.basis(name)
            m, n = p.shape
            if geometry == "bilateral":
                assert u.shape == (m, m) and v.shape == (n, n)
            else:
                assert (u is None) == (m > n) and (v is None) == (m <= n)


# ------------------------------------------------------ second-moment carrying


def _kron_carry(exp_avg_sq: Tensor, p: Tensor, q: Tensor) -> Tensor:
    """diag(K diag(vec V~) K^T) with K = Q^T (x) P: vec(P G~ Q) = K vec(G~) (column-major vec)."""
    m, n = exp_avg_sq.shape
    k = torch.kron(q.T.contiguous(), p.contiguous())  # kron needs contiguous inputs
    cov = k @ torch.diag(exp_avg_sq.T.reshape(-1)) @ k.T
    return torch.diagonal(cov).reshape(n, m).T


def test_carry_formula_matches_kronecker_reference() -> None:
    g = torch.Generator().manual_seed(3)
    m, n = 5, 4
    orth = lambda k: torch.linalg.qr(torch.randn(k, k, generator=g, dtype=torch.float64))[0]
    v = torch.rand(m, n, generator=g, dtype=torch.float64)
    u0, u1, v0, v1 = orth(m), orth(m), orth(n), orth(n)
    got = carry_second_moment(v, u0, u1, v0, v1)
    assert torch.allclose(got, _kron_carry(v, u1.T @ u0, v0.T @ v1), atol=1e-12)
    # identity old basis, one side unchanged; and the total second moment is preserved
    assert torch.allclose(carry_second_moment(v, None, u1, None, None), _kron_carry(v, u1.T, torch.eye(n, dtype=v.dtype)))
    assert torch.allclose(got.sum(), v.sum())


class _Spy(BasisRotationAdamW):
    """Records the second moment and bases around every refresh."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[tuple[Tensor, Tensor | None, Tensor | None, Tensor, Tensor, Tensor]] = []

    def _refresh(self, rot, slot) -> None:
        before = slot.exp_avg_sq.clone()
        old_u, old_v = rot.u, rot.v
        super()._refresh(rot, slot)
        self.events.append((before, old_u, old_v, rot.u, rot.v, slot.exp_avg_sq.clone()))


def test_second_moment_is_carried_into_the_new_basis_by_the_formula() -> None:
    torch.manual_seed(1)
    w = nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    opt = _Spy([("w", w)], lr=1e-2, weight_decay=0.0, rotation=RotationConfig(refresh_interval=3))
    for _ in range(9):
        w.grad = torch.randn(6, 4, dtype=torch.float64) @ torch.diag(torch.tensor([3.0, 1.0, 0.5, 0.1], dtype=torch.float64))
        opt.step(1e-2)
    assert len(opt.events) == 3
    for before, old_u, old_v, new_u, new_v, after in opt.events:
        eye_m, eye_n = torch.eye(6, dtype=w.dtype), torch.eye(4, dtype=w.dtype)
        p = new_u.T @ (old_u if old_u is not None else eye_m)
        q = (old_v if old_v is not None else eye_n).T @ new_v
        assert torch.allclose(after, _kron_carry(before, p, q), rtol=1e-10, atol=1e-14)


# -------------------------------------------------- delayed rotated quadratic


def _delayed_quadratic(kind: str, delay: int, steps: int = 300, lr: float = 0.03) -> float:
    """f(W) = 1/2 vec(W)^T (B (x) A) vec(W), A and B ill-conditioned with random eigenbases;
    the gradient of step t is taken at W_{t - delay}. Returns f at the end."""
    g = torch.Generator().manual_seed(0)
    m, n = 8, 6
    qa = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64))[0]
    qb = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))[0]
    a = qa @ torch.diag(torch.logspace(0, 2, m, dtype=torch.float64)) @ qa.T
    b = qb @ torch.diag(torch.logspace(0, 1, n, dtype=torch.float64)) @ qb.T
    p = nn.Parameter(torch.randn(m, n, generator=g, dtype=torch.float64).float())
    if kind == "adamw":
        opt: StageAdamW = StageAdamW([("w", p)], lr=lr, weight_decay=0.0)
    else:
        opt = BasisRotationAdamW([("w", p)], lr=lr, weight_decay=0.0,
                                 rotation=RotationConfig(geometry=kind, refresh_interval=2))
    history = [p.detach().double().clone()]
    for _ in range(steps):
        stale = history[max(0, len(history) - 1 - delay)]
        p.grad = (a @ stale @ b).float()
        opt.step(lr)
        history.append(p.detach().double().clone())
    w = history[-1]
    return float(0.5 * (w * (a @ w @ b)).sum())


@pytest.mark.parametrize("delay", [4, 8])
def test_bilateral_rotation_converges_faster_than_adamw_under_delay(delay: int) -> None:
    adamw, bilateral = _delayed_quadratic("adamw", delay), _delayed_quadratic("bilateral", delay)
    # measured: delay 4: 106 vs 3.4; delay 8: 1800 vs 220 (start: 3806)
    assert bilateral < 0.25 * adamw, (adamw, bilateral)


# ------------------------------------------------------------ refresh budget


def test_stage_aware_refresh_keeps_the_uniform_budget_and_favours_early_stages() -> None:
    k, n = 4, 8
    steps = k * (n + 1) * 3
    uniform = [sum(refreshes_at(RotationConfig(refresh_interval=k, stage=s, num_stages=n), t)
                   for t in range(1, steps + 1)) for s in range(n)]
    aware = [sum(refreshes_at(RotationConfig(refresh_interval=k, stage_aware=True, stage=s, num_stages=n), t)
                 for t in range(1, steps + 1)) for s in range(n)]
    assert uniform == [steps // k] * n
    assert sum(aware) == sum(uniform)
    assert aware == sorted(aware, reverse=True) and aware[0] > uniform[0] > aware[-1] > 0
    assert [refresh_rate(RotationConfig(refresh_interval=k, stage_aware=True, stage=s, num_stages=n))
            for s in (0, n - 1)] == [pytest.approx(2 * n / (k * (n + 1))), pytest.approx(2 / (k * (n + 1)))]
    assert not any(refreshes_at(RotationConfig(refresh_interval=0), t) for t in range(1, 50))
    assert [t for t in range(1, 13) if refreshes_at(RotationConfig(refresh_interval=4), t)] == [4, 8, 12]


# ------------------------------------------------------------ flags, rollback


def test_rollback_and_post_validation_are_rejected() -> None:
    opt = rotation_opt(make_model())
    with pytest.raises(NotImplementedError, match="post-validation"):
        opt.rollback(1e-3)
    with pytest.raises(SystemExit):
        parse_args(["--optimizer", "basis-rotation", "--enable-optimizer-post-validation"])
    with pytest.raises(SystemExit):
        parse_args(["--rotation-stage-aware"])
    with pytest.raises(SystemExit):
        parse_args(["--optimizer", "basis-rotation", "--rotation-refresh-interval", "-1"])


def test_state_dict_roundtrip_and_adamw_checkpoint_rejected() -> None:
    model_a, model_b = make_model(), make_model()
    a, b = rotation_opt(model_a, refresh_interval=2), rotation_opt(model_b, refresh_interval=2)
    for step in range(5):
        a.zero_grad()
        backward(model_a, step)
        a.step(LRS[step])
    model_b.load_state_dict(model_a.state_dict())
    b.load_state_dict(a.state_dict())
    for step in range(5, 6):
        for model, opt in ((model_a, a), (model_b, b)):
            opt.zero_grad()
            backward(model, step)
            opt.step(LRS[step])
    assert_params_equal(model_a, model_b)
    plain = StageAdamW(list(make_model().named_parameters()), lr=1e-3, weight_decay=0.0)
    with pytest.raises(ValueError, match="basis-rotation state"):
        b.load_state_dict(plain.state_dict())
    with pytest.raises(ValueError, match="basis-rotation state"):
        plain.load_state_dict(b.state_dict())


def test_bf16_params_rotate_fp32_masters() -> None:
    """bf16 weights: bases, statistics and moments live in the fp32 master's dtype."""
    model = make_model().to(torch.bfloat16)
    opt = rotation_opt(model, refresh_interval=1)
    for step in range(4):
        opt.zero_grad()
        backward(model, step)
        opt.step(LRS[step])
    u, v = opt.basis("0.weight")
    assert u.dtype == v.dtype == torch.float32
    assert torch.equal(model[0].weight, opt.master_weight("0.weight").to(torch.bfloat16))
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---------------------------------------------------------------- tiny GPT


TOTAL, STOP = 12, 6
ROTATION = ("--optimizer", "basis-rotation", "--rotation-refresh-interval", "2", "--rotation-stage-aware")


def test_tiny_gpt_paci_trains(megatron_world1, tmp_path: Path) -> None:
    """40 PACI iterations (2 stages, 4 micro-batches per update): the loss falls by > 0.5
    (measured: ~3.45 -> ~2.5), and the stage optimizers really left the identity basis."""
    log = tmp_path / "log.jsonl"
    workers = emulate([*tiny_args(2, "paci", 4, 40, "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
                                  "--lr-decay-style", "constant"), *ROTATION, "--log-json", str(log)])
    assert all(isinstance(w.setup.optimizer, BasisRotationAdamW) for w in workers)
    for w in workers:
        opt = w.setup.optimizer
        assert any("linear_qkv" in name for name in opt.rotated_names)
        assert all(u is not None or v is not None for u, v in map(opt.basis, opt.rotated_names))
    losses = [loss for _, loss in _losses(log)]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses


def _argv(log: Path, *more: str) -> list[str]:
    return [*tiny_args(2, "paci", 4, TOTAL, "--hidden-dropout", "0.1", "--attention-dropout", "0.1"),
            *ROTATION, "--log-json", str(log), *more]


def test_tiny_gpt_paci_resumes_bitwise(megatron_world1, tmp_path: Path) -> None:
    """Stopped at a checkpoint and resumed == trained straight through (same segment cut)."""
    straight_log, resumed_log = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl"
    straight = final_params(emulate(_argv(straight_log, "--save", str(tmp_path / "a"), "--save-interval", str(STOP))))
    emulate(_argv(resumed_log, "--save", str(tmp_path / "b"), "--exit-interval", str(STOP)))
    assert (tmp_path / "b" / ckpt.POINTER).read_text().strip() == str(STOP)
    resumed = final_params(emulate(_argv(resumed_log, "--load", str(tmp_path / "b"))))
    assert _losses(resumed_log) == _losses(straight_log)
    assert [it for it, _ in _losses(resumed_log)] == list(range(1, TOTAL + 1))
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


ASYNC = [("paci", "bilateral", "second-moment"), ("async-1f1b", "unilateral", "momentum"),
         ("pipedream-2bw", "unilateral", "second-moment"), ("pipemare", "bilateral", "momentum"),
         ("amdp", "bilateral", "second-moment")]


@pytest.mark.parametrize("schedule,geometry,source", ASYNC, ids=[a[0] for a in ASYNC])
def test_every_async_schedule_steps_stage_locally_with_rotation(megatron_world1, schedule: str, geometry: str,
                                                                source: str) -> None:
    """Each asynchronous schedule (its weight policy included) runs the rotated optimizer per
    stage: every stage stepped, left the identity basis, and kept finite weights."""
    workers = emulate([*tiny_args(2, schedule, 4, 4), *SCHEDULE_FLAGS[schedule], "--optimizer", "basis-rotation",
                       "--rotation-geometry", geometry, "--rotation-source", source,
                       "--rotation-refresh-interval", "1", "--rotation-stage-aware"])
    for w in workers:
        opt = w.setup.optimizer
        assert isinstance(opt, BasisRotationAdamW) and opt.step_count == 4
        assert opt.rotation.stage == w.stage and opt.rotation.num_stages == len(workers)
        assert all(u is not None or v is not None for u, v in map(opt.basis, opt.rotated_names))
    assert all(torch.isfinite(v).all() for v in final_params(workers).values())


# ------------------------------------------------- independent float64 reference


def _against_reference(shape: tuple[int, int], geometry: str, source: str, interval: int, steps: int) -> float:
    """Largest relative weight difference between BasisRotationAdamW and the numpy re-derivation
    (tests/rotation_oracle.py) over ``steps`` float64 steps with varying lr and grad scale."""
    import numpy as np

    from tests.rotation_oracle import RotatedAdamW

    g = torch.Generator().manual_seed(7)
    m, n = shape
    weight = nn.Parameter(torch.randn(m, n, generator=g, dtype=torch.float64))
    opt = BasisRotationAdamW([("layer.weight", weight)], lr=LRS[0], weight_decay=WD, betas=BETAS, eps=EPS,
                             rotation=RotationConfig(geometry=geometry, source=source, refresh_interval=interval))
    rows, cols = (True, True) if geometry == "bilateral" else (m <= n, n < m)
    ref = RotatedAdamW(weight.detach().numpy(), WD, BETAS, EPS, source, rows, cols, interval)
    mix = torch.randn(n, n, generator=g, dtype=torch.float64)  # correlated columns: a non-trivial basis
    worst = 0.0
    for step in range(steps):
        grad = torch.randn(m, n, generator=g, dtype=torch.float64) @ mix + 0.3 * weight.detach()
        weight.grad = grad
        lr, scale = LRS[step % len(LRS)], 0.5 if step % 5 == 3 else 1.0
        opt.step(lr, grad_scale=scale)
        ref.step(grad.numpy() * scale, lr)
        diff = np.abs(weight.detach().numpy() - ref.w).max() / np.abs(ref.w).max()
        worst = max(worst, float(diff))
    u, v = opt.basis("layer.weight")
    assert (u is not None) == rows and (v is not None) == cols
    return worst


@pytest.mark.parametrize("source", ["second-moment", "momentum"])
@pytest.mark.parametrize("geometry", ["bilateral", "unilateral"])
@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
def test_refresh_and_rotated_adam_steps_match_an_independent_reference(shape, geometry, source) -> None:
    """Refreshes every 3 steps (the second-moment statistics have full rank by the first one),
    40 steps: the weights agree to rounding, bilateral + momentum on non-square weights included
    (its larger side's statistic M^T M is rank deficient, completed on its null space)."""
    assert _against_reference(shape, geometry, source, interval=3, steps=40) < 1e-10


def test_bilateral_momentum_refreshing_every_step_stays_on_the_reference() -> None:
    """The hardest case for the larger side's rank-deficient basis: a refresh after every step."""
    assert _against_reference((6, 10), "bilateral", "momentum", interval=1, steps=40) < 1e-10
