"""Tolerances for "trains like the reference" tests, derived from the numerics.

Two fp32 runs that compute the same model in a different reduction order (tensor parallelism
splits a matmul's inner dimension over ranks and sums the halves; another ISA's GEMM blocks it
differently; a pipeline sums gradient norms per stage) cannot agree bit for bit. How far they
may drift apart is a property of the arithmetic, so the bound is computed here, per element,
from quantities of the run itself, instead of a constant tuned on one CPU's kernels (an AMD
AVX-512 host put one element of 4096 at 1.097e-5 against a hand-set ``atol=1e-5``).

1. **Gradients.** A sum of ``K`` fp32 terms in another order differs by at most ``gamma_K``
   times the sum of the terms' magnitudes; for rounding errors that behave like independent
   zero-mean variables the bound is ``lam * sqrt(K) * u`` with probability
   ``>= 1 - 2 exp(-lam^2 / 2)`` (Higham & Mary, "A new approach to probabilistic rounding error
   analysis", SISC 2019), ``u = 2^-24``. A gradient element is the end of a chain of
   ``reductions`` such sums (forward and backward through every layer on its path), each
   adding its own independent relative error to a residual stream that LayerNorm keeps at unit
   scale, so the errors add like ``reductions * K`` independent roundings and
   :func:`gradient_noise` gives ``rho = lam * sqrt(reductions * K) * u`` relative to the
   magnitude of the terms. The terms of
   one tensor's gradient are of the size of that tensor's largest gradient element ``G``, so an
   element's gradient is known to ``rho * G`` absolute, however close to zero it is.

2. **Adam.** Step ``t`` moves an element by ``lr_t * mhat / (sqrt(vhat) + eps)``.
   - That ratio is bounded whatever the gradients: ``|mhat| / sqrt(vhat) <= R_t`` with
     ``R_t = sqrt(sum_j a_j^2 / b_j) * sqrt(1 - b2^t) / (1 - b1^t)``, ``a_j = (1-b1) b1^(t-j)``,
     ``b_j = (1-b2) b2^(t-j)`` (Cauchy-Schwarz; ``R_1 = 1``). Two runs therefore never differ
     by more than ``2 R_t lr_t`` in one step: where an element's true gradient is below the
     noise, rounding picks the sign of its step (Adam normalises it, it does not shrink it).
   - Where the gradient is resolved, the step's derivative with respect to the gradients of
     steps ``1..t`` is at most ``S_t / (sqrt(vhat_t) + eps)`` per unit of gradient, with
     ``S_t = 1 + R_t sqrt(t)`` (the ``mhat`` term's weights sum to 1; the ``vhat`` term's
     ``sqrt(b_j / (1 - b2^t))`` sum to at most ``sqrt(t)`` and multiply ``R_t``).
   So step ``t`` contributes ``lr_t * min(2 R_t, S_t * rho * G / (sqrt(vhat_t) + eps))``, and
   the steps add. The denominators are the reference run's own, read after each of its steps.

3. **Parameter arithmetic.** Each step rounds the parameter twice (decay, update): another
   ``2 u |p|`` per step, which the sum above does not contain.

The bound stays tight where it can: an element whose gradient is resolved at every step gets
``~ lr * rho`` (about 1e-8 for lr = 1e-3), so a real bug, which moves parameters by ~lr per
step, fails it by orders of magnitude; only elements whose gradient sank into the noise at
some step get up to ``2 lr`` per step. Losses and gradient norms are smooth functions of the
whole model and carry the same ``rho`` as a relative tolerance (:func:`gradient_noise`).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Iterator

import torch

U32 = 2.0 ** -24  # fp32 unit roundoff
LAM = 3.0  # probabilistic rounding-error bound's lambda: exceeded with probability < 2 exp(-4.5) = 0.022 per sum


def gradient_noise(reduction_len: int, reductions: int, lam: float = LAM) -> float:
    """Relative difference of fp32 gradients (and losses) that sum the same terms in another order.

    ``reduction_len``: the longest sum in the model (hidden, FFN width, vocabulary, tokens per
    optimizer step); ``reductions``: how many such sums lie on a gradient's path (forward and
    backward through each layer, plus the head). See the module docstring, item 1.
    """
    return lam * math.sqrt(reductions * reduction_len) * U32


def gpt_gradient_noise(num_layers: int, hidden: int, ffn: int, vocab: int, tokens_per_step: int) -> float:
    """:func:`gradient_noise` for a GPT: per layer attention (QKV, scores, context, projection) and
    MLP (fc1, fc2) forward and again backward; plus the embedding, the head and the loss."""
    longest = max(hidden, ffn, vocab, tokens_per_step)
    return gradient_noise(longest, reductions=2 * 6 * num_layers + 3)


def half_precision_noise(unit_roundoff: float, num_layers: int, accumulated: int, lam: float = LAM) -> float:
    """Relative difference of a half-precision run's losses and gradient norms from fp32's.

    The products accumulate in fp32 (CPU and GPU GEMMs alike), so each op's output is rounded to
    the half format once: relative ``unit_roundoff`` (bf16 ``2^-8``, fp16 ``2^-11``) per op, and
    the same ``2 * 6 * num_layers + 3`` ops as :func:`gpt_gradient_noise` lie on a gradient's
    path; summing ``accumulated`` micro-batches' gradients in the half format rounds once per
    micro-batch more. Independent zero-mean roundings add like ``lam * sqrt(n) * u`` (Higham &
    Mary, module docstring item 1), and, as there, losses and norms carry the same ``rho``."""
    return lam * math.sqrt(2 * 6 * num_layers + 3 + accumulated) * unit_roundoff


def ratio_bound(betas: tuple[float, float], t: int) -> float:
    """``R_t``: the largest ``|mhat_t| / sqrt(vhat_t)`` any gradient sequence can give (item 2)."""
    b1, b2 = betas
    weights = sum(((1 - b1) * b1 ** (t - j)) ** 2 / ((1 - b2) * b2 ** (t - j)) for j in range(1, t + 1))
    return math.sqrt(weights) * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)


@dataclass
class _Steps:
    """What one parameter's optimizer steps did in the reference run."""

    lrs: list[float] = field(default_factory=list)
    ts: list[int] = field(default_factory=list)
    denominators: list[torch.Tensor] = field(default_factory=list)  # sqrt(vhat_t) + eps, after step t
    largest_grad: float = 0.0  # G: max |scaled gradient| over the steps


class AdamTrace:
    """Records, per parameter, every AdamW step of an in-process run (the emulator reference).

    Use :func:`trace_adam`; then :meth:`bounds` gives each parameter's element-wise tolerance.
    """

    def __init__(self) -> None:
        # (parameter name, owned range, id(optimizer)) -> its steps. By name: AMDP's replicated
        # pipelines hold one copy of a parameter each and each replica steps its range of it.
        self.steps: dict[tuple[str, tuple[int, int] | None, int], _Steps] = {}
        self.betas: tuple[float, float] = (0.9, 0.999)
        self.eps: float = 1e-8

    def record(self, optimizer, lr: float, grad_scale: float, run_step) -> None:
        from megatron.trainer.optim.adamw import StageAdamW

        assert type(optimizer) is StageAdamW, f"the bound is derived for plain AdamW, not {type(optimizer).__name__}"
        # G is the whole tensor's scale, also where this optimizer owns only a range of it (ZeRO, AMDP).
        largest = {}
        for slot in optimizer._slots:
            grad = slot.param.grad
            largest[id(slot)] = 0.0 if grad is None else float(grad.detach().abs().max()) * grad_scale
        run_step()
        self.betas, self.eps = optimizer.betas, optimizer.eps
        t = optimizer.step_count
        correction = math.sqrt(1 - optimizer.betas[1] ** t)
        for slot in optimizer._slots:
            steps = self.steps.setdefault((slot.name, slot.index, id(optimizer)), _Steps())
            steps.lrs.append(lr)
            steps.ts.append(t)
            steps.denominators.append(slot.exp_avg_sq.sqrt() / correction + optimizer.eps)
            steps.largest_grad = max(steps.largest_grad, largest[id(slot)])

    def bound(self, name: str, param: torch.nn.Parameter, rho: float) -> torch.Tensor:
        """Element-wise ``|ours - reference|`` bound for parameter ``name`` (value ``param``) after
        the recorded steps.

        A parameter whose optimizer state is sharded (each owner steps a flat range) gets each
        range's bound from its owner's steps."""
        flat = torch.full((param.numel(),), float("nan"), dtype=torch.float64)
        for (key, index, _), steps in self.steps.items():
            if key != name:
                continue
            lo, hi = index if index is not None else (0, param.numel())
            flat[lo:hi] = self._bound(steps, param.detach().reshape(-1)[lo:hi], rho)
        assert not bool(flat.isnan().any()), f"{name}: an element no recorded optimizer stepped"
        return flat.view(param.shape)

    def _bound(self, steps: _Steps, values: torch.Tensor, rho: float) -> torch.Tensor:
        noise = rho * steps.largest_grad
        total = torch.zeros_like(values, dtype=torch.float64)
        for lr, t, denominator in zip(steps.lrs, steps.ts, steps.denominators):
            r = ratio_bound(self.betas, t)
            resolved = (1 + r * math.sqrt(t)) * noise / denominator.double().reshape(-1)
            total += lr * torch.clamp(resolved, max=2 * r)
        return total + 2 * len(steps.lrs) * U32 * values.abs().double()


@contextlib.contextmanager
def trace_adam() -> Iterator[AdamTrace]:
    """Record every ``StageAdamW.step`` taken in this process while the context is open."""
    from megatron.trainer.optim.adamw import StageAdamW

    trace = AdamTrace()
    original = StageAdamW.step

    def step(self, lr: float, grad_scale: float = 1.0, grads_disposable: bool = False) -> None:
        trace.record(self, lr, grad_scale, lambda: original(self, lr, grad_scale, grads_disposable))

    StageAdamW.step = step
    try:
        yield trace
    finally:
        StageAdamW.step = original


def assert_within_bounds(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
                         bounds: dict[str, torch.Tensor], context: str = "") -> float:
    """Every element of every parameter within its bound; returns the largest |diff| / bound.

    The returned ratio lets a test also check the bound is not vacuous where it matters.
    """
    assert ours.keys() == reference.keys(), context
    worst = 0.0
    for name, ref in reference.items():
        assert ours[name].shape == ref.shape, (context, name)
        diff = (ours[name].double() - ref.double()).abs()
        bound = bounds[name]
        over = diff > bound
        if bool(over.any()):
            i = int(torch.argmax((diff - bound).flatten()))
            raise AssertionError(
                f"{context}{name}: {int(over.sum())} of {diff.numel()} elements beyond the derived bound; "
                f"worst element {i}: |diff| {float(diff.flatten()[i]):.4g} > bound {float(bound.flatten()[i]):.4g}")
        worst = max(worst, float((diff / bound.clamp_min(1e-300)).max()))
    return worst
