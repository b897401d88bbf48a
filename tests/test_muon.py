"""Tests for ``--optimizer muon`` (megatron.trainer.optim.muon).

One stage equals torch 2.13's ``torch.optim.Muon`` (2-D hidden weights) + ``torch.optim.AdamW``
(the rest) bit for bit, update by update; the fp32 Newton–Schulz stays within its derived
rounding bound of a float64 iteration written out separately; a fused QKV weight is
orthogonalised per Q/K/V block; rollback restores the pre-step state (bitwise from the backup,
within the step's rounding in place); checkpoints resume bitwise; the distributed runtime equals
the emulator bitwise on an asynchronous schedule; bad combinations are refused in one line.
"""
from __future__ import annotations

import math
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
from test_checkpoint_resume import SCHEDULE_FLAGS, _losses
from test_optimizer import BETAS, EPS, LRS, WD, roundtrip
from test_post_validation import assert_paths_exercised, assert_same_training
from torch import nn

from megatron.trainer.optim.adamw import StageAdamW
from megatron.trainer.optim.muon import MuonConfig, StageMuon
from megatron.trainer.optim.newton_schulz import QUINTIC, newton_schulz

MOMENTUM = 0.9


class Net(nn.Module):
    """Embedding -> two hidden linears (one tall, one wide) + a norm -> output layer."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = nn.Embedding(11, 6)
        self.up = nn.Linear(6, 10)
        self.norm = nn.LayerNorm(10)
        self.down = nn.Linear(10, 6, bias=False)
        self.output_layer = nn.Linear(6, 11)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output_layer(self.down(torch.tanh(self.norm(self.up(self.embedding(tokens))))))


HIDDEN = ("up.weight", "down.weight")


def backward(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, 11, (4, 5), generator=gen)
    logits = model(tokens)
    nn.functional.cross_entropy(logits.view(-1, 11), torch.roll(tokens, 1, 1).reshape(-1)).backward()


def muon_opt(model: nn.Module, exact: bool = False, **config) -> StageMuon:
    return StageMuon(list(model.named_parameters()), lr=LRS[0], weight_decay=WD, betas=BETAS, eps=EPS, exact=exact,
                     muon=MuonConfig(**{"momentum": MOMENTUM, **config}))


def torch_reference(model: nn.Module, nesterov: bool) -> tuple[torch.optim.Muon, torch.optim.AdamW]:
    """torch's Muon on the hidden weights (its "original" lr adjustment = shape_scaling) and
    AdamW with Megatron's decay groups on the rest."""
    named = dict(model.named_parameters())
    muon = torch.optim.Muon([named[n] for n in HIDDEN], lr=LRS[0], weight_decay=WD, momentum=MOMENTUM,
                            nesterov=nesterov, adjust_lr_fn="original")
    rest = [(n, p) for n, p in named.items() if n not in HIDDEN]
    decay = [p for n, p in rest if not (n.endswith("bias") or p.ndim == 1)]
    no_decay = [p for n, p in rest if n.endswith("bias") or p.ndim == 1]
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=LRS[0], betas=BETAS, eps=EPS, foreach=False)
    return muon, adamw


@pytest.mark.parametrize("nesterov", [False, True])
def test_one_stage_equals_torch_muon_and_adamw_bitwise(nesterov: bool) -> None:
    ours_model, ref_model = Net(), Net()
    ours = muon_opt(ours_model, use_nesterov=nesterov, scale_mode="shape_scaling", ns_dtype="bfloat16")
    assert ours.orthogonalised_names == frozenset(HIDDEN)
    muon, adamw = torch_reference(ref_model, nesterov)
    for step, lr in enumerate(LRS):
        for model in (ours_model, ref_model):
            model.zero_grad()
            backward(model, step)
        ours.step(lr)
        for opt in (muon, adamw):
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
        for (name, a), b in zip(ours_model.named_parameters(), ref_model.parameters()):
            assert torch.equal(a, b), (step, name)


def _ns_float64(x: np.ndarray, steps: int) -> np.ndarray:
    """The quintic iteration, written out in float64 numpy (no torch)."""
    a, b, c = QUINTIC
    tall = x.shape[0] > x.shape[1]
    y = x.T if tall else x
    y = y / max(np.linalg.norm(y), 1e-7)
    for _ in range(steps):
        gram = y @ y.T
        y = a * y + (b * gram + c * gram @ gram) @ y
    return y.T if tall else y


@pytest.mark.parametrize("shape", [(10, 6), (6, 10), (8, 8)])
def test_float32_newton_schulz_is_within_its_rounding_bound_of_float64(shape) -> None:
    """Bound: each step multiplies an input error by at most L = max |p'(s)| on the singular
    values' range (p(s) = a s + b s^3 + c s^5; s stays in [0, 1.2]) and adds ~ k eps32 of
    rounding (k = the inner dimension of the products): after `steps` steps the error is
    below eps32 * k * sum L^i <= eps32 * k * steps * L^steps."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    steps = 5
    got = newton_schulz(x.float(), steps).double().numpy()
    want = _ns_float64(x.numpy(), steps)
    bound = torch.finfo(torch.float32).eps * max(shape) * steps * ns_error_gain(steps)
    assert np.abs(got - want).max() <= bound, (np.abs(got - want).max(), bound)
    singular = np.linalg.svd(want, compute_uv=False)
    assert singular.min() > 0.5 and singular.max() < 1.3, singular  # orthogonalised, as published


def test_fused_qkv_is_orthogonalised_per_block_of_every_query_group() -> None:
    """2 query groups of (q, k, v) = (4, 2, 2) rows: each of Q, K, V (its rows from both groups)
    is orthogonalised and scaled alone."""
    split = (4, 2, 2)
    weight = torch.randn(16, 5, generator=torch.Generator().manual_seed(1))
    param = nn.Parameter(weight.clone())
    opt = StageMuon([("layer.self_attention.linear_qkv.weight", param)], lr=0.1, weight_decay=0.0,
                    muon=MuonConfig(momentum=0.0, qkv_split=split, scale_mode="spectral"))
    grad = torch.randn(16, 5, generator=torch.Generator().manual_seed(2))
    param.grad = grad.clone()
    opt.step(0.1)
    rows = {"q": [0, 1, 2, 3, 8, 9, 10, 11], "k": [4, 5, 12, 13], "v": [6, 7, 14, 15]}
    want = weight.clone()
    for idx in rows.values():
        block = grad[idx]
        want[idx] = weight[idx] - (newton_schulz(block, 5) * math.sqrt(max(block.shape))) * 0.1
    assert torch.allclose(param.detach(), want, rtol=0, atol=4 * torch.finfo(torch.float32).eps)


def test_a_qkv_weight_that_does_not_split_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be split for Muon"):
        StageMuon([("linear_qkv.weight", nn.Parameter(torch.zeros(10, 4)))], lr=0.1, weight_decay=0.0,
                  muon=MuonConfig(qkv_split=(4, 2, 2)))


def test_exact_rollback_is_bitwise() -> None:
    model = Net()
    opt = muon_opt(model, exact=True, use_nesterov=True)
    for step in range(3):
        model.zero_grad()
        backward(model, step)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        state = roundtrip(opt.state_dict())
        opt.step(LRS[step], grad_scale=0.5)
        opt.rollback(LRS[step], grad_scale=0.5)
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n]), n
        after = opt.state_dict()
        for n, entry in state["params"].items():
            for key, value in entry.items():
                assert torch.equal(after["params"][n][key], value), (n, key)
        opt.step(LRS[step], grad_scale=0.5)  # and train on


def test_in_place_rollback_is_within_the_steps_rounding() -> None:
    """The inverse recomputes the step's own O (same momentum, same gradient: bitwise) and undoes
    ``W (1 - lr wd) - lr s O`` in float64: what remains is the step's two fp32 roundings,
    <= eps32 (|W| + lr s |O|) per element; the momentum's lerp, <= eps32 (|B| + |g|)."""
    model = Net()
    opt = muon_opt(model, use_nesterov=True)
    eps = torch.finfo(torch.float32).eps
    for step in range(3):
        model.zero_grad()
        backward(model, step)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        momentum = {n: opt.state_dict()["params"][n]["exp_avg"] for n in HIDDEN}
        opt.step(LRS[step])
        moved = {n: (p.detach() - before[n]).abs() for n, p in model.named_parameters()}
        opt.rollback(LRS[step])
        for n in HIDDEN:
            p = dict(model.named_parameters())[n]
            assert moved[n].max() > 0
            bound = eps * (before[n].abs() + 2 * moved[n])
            assert ((p.detach() - before[n]).abs() <= bound).all(), n
            grad = p.grad.abs()
            restored = opt.state_dict()["params"][n]["exp_avg"]
            assert ((restored - momentum[n]).abs() <= eps * (momentum[n].abs() + grad) / MOMENTUM).all(), n
        opt.step(LRS[step])


def test_state_dict_resumes_bitwise_and_other_optimizers_checkpoints_are_refused() -> None:
    straight, resumed = Net(), Net()
    a = muon_opt(straight, use_nesterov=True)
    for step in range(3):
        straight.zero_grad()
        backward(straight, step)
        a.step(LRS[step])
    saved = roundtrip(a.state_dict())
    resumed.load_state_dict(straight.state_dict())
    b = muon_opt(resumed, use_nesterov=True)
    b.load_state_dict(saved)
    for step in range(3, 6):
        for model, opt in ((straight, a), (resumed, b)):
            model.zero_grad()
            backward(model, step)
            opt.step(LRS[step])
    for (name, x), y in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(x, y), name
    adamw = StageAdamW(list(Net().named_parameters()), lr=LRS[0], weight_decay=WD)
    with pytest.raises(ValueError, match="Muon state"):
        adamw.load_state_dict(saved)
    with pytest.raises(ValueError, match="no Muon state"):
        muon_opt(Net()).load_state_dict(adamw.state_dict())


# ---------------------------------------------------------------- tiny GPT

MUON = ("--optimizer", "muon", "--muon-use-nesterov")
TOTAL, STOP = 12, 6


@pytest.mark.parametrize("schedule", ["paci", "async-1f1b", "pipedream-2bw", "pipemare", "amdp"])
def test_every_async_schedule_steps_muon_stage_locally(megatron_world1, schedule: str) -> None:
    workers = emulate([*tiny_args(2, schedule, 4, 4), *SCHEDULE_FLAGS[schedule], *MUON])
    for w in workers:
        opt = w.setup.optimizer
        assert isinstance(opt, StageMuon) and opt.step_count == 4
        assert any("linear_qkv.weight" in n for n in opt.orthogonalised_names)
        assert not any("embedding" in n or "output_layer" in n for n in opt.orthogonalised_names)
    assert all(torch.isfinite(v).all() for v in final_params(workers).values())


def test_tiny_gpt_paci_trains_with_muon(megatron_world1, tmp_path: Path) -> None:
    """30 PACI iterations: the loss falls by > 0.5 (it starts at ~ln 32 = 3.47)."""
    log = tmp_path / "log.jsonl"
    emulate([*tiny_args(2, "paci", 4, 30, "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
                        "--lr-decay-style", "constant"), *MUON, "--log-json", str(log)])
    losses = [loss for _, loss in _losses(log)]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses


def test_tiny_gpt_pipedream_2bw_resumes_bitwise(megatron_world1, tmp_path: Path) -> None:
    """PipeDream-2BW's stash crosses the checkpoint; Muon's momentum comes back bitwise."""
    argv = [*tiny_args(2, "pipedream-2bw", 4, TOTAL, "--hidden-dropout", "0.1", "--attention-dropout", "0.1"), *MUON]
    assert_emulated_resume_is_bitwise(argv, TOTAL, STOP, tmp_path)


def test_distributed_runtime_equals_emulator_with_muon(megatron_world1, tmp_path: Path) -> None:
    """Async 1F1B (stage-local steps between forwards and backwards) on 2 processes."""
    assert_runtime_equals_emulator([*tiny_args(2, "async-1f1b", 1, 6, "--hidden-dropout", "0.1"), *MUON],
                                   tmp_path / "dist")


def _post_validated(schedule: str, tmp_path: Path, *extra: str):
    from test_post_validation import _train

    return _train(4, schedule, *MUON, *extra, tmp_path=tmp_path, tag="muon")


def ns_error_gain(steps: int) -> float:
    """How much ``steps`` quintic steps can amplify a relative input error: ``L^steps`` with
    ``L = max |p'(s)|`` over the singular values' range [0, 1.2]."""
    a, b, c = QUINTIC
    s = np.linspace(0.0, 1.2, 1201)
    return float(np.abs(a + 3 * b * s**2 + 5 * c * s**4).max()) ** steps


def test_post_validated_muon_with_exact_rollback_equals_1f1b_flush_bitwise(megatron_world1, tmp_path: Path) -> None:
    """ZB-H1 with post-validation (some iterations clipped: rolled back and redone) against
    1F1B-flush: bitwise with the backup."""
    baseline = _post_validated("1f1b", tmp_path)
    run = _post_validated("zb-h1", tmp_path, "--enable-optimizer-post-validation", "--optimizer-post-validation-exact")
    assert_paths_exercised(*run)
    assert_same_training(run, baseline, exact=True)


def test_post_validated_muon_with_in_place_rollback_stays_within_its_rounding(megatron_world1,
                                                                               tmp_path: Path) -> None:
    """The in-place inverse leaves a few ulp per rollback (test_in_place_rollback_...); the next
    Newton-Schulz step may amplify a relative error by up to ns_error_gain(5) (~900). So every
    final weight is held to rollbacks x eps32 x gain relative to 1F1B-flush: far below one step
    (a missed or doubled rollback moves weights by ~lr = 1e-2 relative)."""
    baseline_workers, baseline_records = _post_validated("1f1b", tmp_path)
    workers, records = _post_validated("zb-h1", tmp_path, "--enable-optimizer-post-validation")
    assert_paths_exercised(workers, records)
    rollbacks = sum(w.post_validation.rollbacks for w in workers)
    bound = rollbacks * torch.finfo(torch.float32).eps * ns_error_gain(5)
    assert [r["iteration"] for r in records] == [r["iteration"] for r in baseline_records]
    for got, want in zip(records, baseline_records):
        assert math.isclose(got["loss"], want["loss"], rel_tol=bound), (got, want)
    got_params, want_params = final_params(workers), final_params(baseline_workers)
    for name, want in want_params.items():
        rel = ((got_params[name] - want).norm() / want.norm()).item()
        assert rel <= bound, (name, rel, bound)


@pytest.mark.parametrize("argv,fragment", [
    (["--optimizer", "muon", "--use-distributed-optimizer"], "does not shard into element ranges"),
    (["--optimizer", "muon", "--muon-momentum", "1.0"], "--muon-momentum must be in [0, 1)"),
    (["--optimizer", "muon", "--muon-num-ns-steps", "0"], "--muon-num-ns-steps must be >= 1"),
    (["--optimizer", "muon", "--adam-kernel", "fused"], "has its own update"),
    (["--muon-use-nesterov"], "--muon-use-nesterov needs --optimizer muon"),
    (["--muon-num-ns-steps", "3"], "--muon-num-ns-steps needs --optimizer muon"),
    (["--optimizer", "muon", "--muon-scale-mode", "bogus"], "invalid choice"),
    (["--optimizer", "muon", "--pipeline-schedule", "amdp", "--amdp-optimizer-state", "sharded"],
     "needs an optimizer with element-wise state"),
    (["--optimizer", "muon", "--tensor-model-parallel-size", "2", "--pipeline-executor", "distributed"],
     "Newton-Schulz of a weight's shard is not that of the full weight"),
])
def test_bad_muon_flags_are_refused_in_one_line(capsys, argv: list[str], fragment: str) -> None:
    assert_flag_error(capsys, ["--mock-data", *argv], fragment)


@pytest.mark.parametrize("precision", [("--bf16",), ("--fp16", "--loss-scale-window", "3")], ids=["bf16", "fp16"])
def test_half_precision_muon_steps_fp32_masters(megatron_world1, precision: tuple[str, ...]) -> None:
    """bf16/fp16 weights (12 PACI updates): Muon steps the fp32 masters, the weights are their
    rounding, and everything stays finite (fp16: through the stage-local loss scales)."""
    workers = emulate([*tiny_args(2, "paci", 4, 12, "--lr-decay-style", "constant"), *MUON, *precision])
    half = torch.bfloat16 if precision[0] == "--bf16" else torch.float16
    for w in workers:
        opt = w.setup.optimizer
        for name in opt.orthogonalised_names:
            master = opt.master_weight(name)
            param = dict(opt.named_parameters())[name]
            assert master.dtype == torch.float32 and param.dtype == half
            assert torch.equal(param.detach(), master.to(half)), name
    assert all(torch.isfinite(v.float()).all() for v in final_params(workers).values())
