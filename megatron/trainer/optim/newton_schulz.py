"""Muon's orthogonalisation: a quintic Newton–Schulz iteration and the update's scale factor.

Written here because megatron-core's Muon (``megatron.core.optimizer.muon``) delegates both to
the ``emerging-optimizers`` package, which is not installed with the pinned wheel; the iteration
is the published one (Keller Jordan's Muon, the coefficients torch 2.13's ``torch.optim.Muon``
uses), in the same operation order as torch's ``_zeropower_via_newtonschulz`` so that a
bfloat16 run reproduces it bit for bit.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

#: (a, b, c) of the quintic ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``
QUINTIC = (3.4445, -4.7750, 2.0315)
#: the norm's floor before the first division (a zero matrix stays zero)
NS_EPS = 1e-7
#: megatron-core's ``--muon-scale-mode`` names, formulas below
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
#: the dtypes the iteration may run in (bf16: the published recipe; fp32: the master's precision)
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def newton_schulz(x: Tensor, steps: int, dtype: torch.dtype = torch.float32,
                  coefficients: tuple[float, float, float] = QUINTIC, eps: float = NS_EPS) -> Tensor:
    """An approximate ``U V^T`` of ``x = U S V^T`` (singular values pushed into ~[0.7, 1.2]).

    Why the transpose: the Gram matrix ``X X^T`` is taken on the smaller side, so the cost is
    ``O(min(m, n)^2 max(m, n))``. Why the normalisation: the iteration only converges for a
    spectral norm <= 1, and the Frobenius norm bounds it. Returns a tensor of ``dtype``.
    """
    if x.ndim != 2:
        raise ValueError(f"newton_schulz: a matrix is needed, got shape {tuple(x.shape)}")
    if steps < 1:
        raise ValueError(f"newton_schulz: steps must be >= 1, got {steps}")
    a, b, c = coefficients
    out = x.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        out = out.T
    out.div_(out.norm().clamp(min=eps))
    for _ in range(steps):
        gram = out @ out.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        out = torch.addmm(out, poly, out, beta=a)
    return out.T if tall else out


def scale_factor(rows: int, cols: int, mode: str) -> float:
    """The factor on the orthogonalised update of a ``rows x cols`` weight.

    ``shape_scaling``: ``sqrt(max(1, rows / cols))`` (Keller Jordan's original, torch's
    ``adjust_lr_fn="original"``); ``spectral``: ``sqrt(max(rows, cols))`` (an update of unit
    spectral norm scaled to the RMS of a dense matrix; Moonshot's AdamW-matched recipe is this
    times 0.2, i.e. ``--muon-extra-scale-factor 0.2``); ``unit_rms_norm``: ``sqrt(rows / cols)``.
    """
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "spectral":
        return math.sqrt(max(rows, cols))
    if mode == "unit_rms_norm":
        return math.sqrt(rows / cols)
    raise ValueError(f"muon scale mode must be one of {SCALE_MODES}, got {mode!r}")
