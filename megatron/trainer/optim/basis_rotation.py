"""Basis-rotation Adam for asynchronous pipelines (Jung, Shin, Lee, ICML 2026).

Why: under gradient staleness Adam degrades when the Hessian's eigenbasis is not aligned
with the coordinate axes (its per-coordinate scaling then cannot damp the dominant
direction, the trajectory oscillates, and stale gradients point the wrong way). Running Adam
in a basis that approximately diagonalises the Hessian restores robustness to delay.

For a 2-D weight ``W`` (m x n) with gradient ``G`` the Kronecker-factored rotation is
``U`` (m x m, eigenvectors of ``L = E[G G^T]``) and ``V`` (n x n, of ``R = E[G^T G]``):

* ``bilateral``:  Adam on ``G~ = U^T G V``, update ``W -= step * U (M~ / sqrt(V~)) V^T``;
* ``unilateral``: only the smaller side is rotated (``U^T G`` if m <= n, else ``G V``).

Choices made here where the paper (blog text in ``../shared/papers`` next to the repository) is not explicit;
``docs/design.md`` lists them too:

* The first moment ``M`` is kept in the *original* basis (``M~ = U^T M V`` is formed each
  step), so a basis refresh needs no transformation of it and the ``momentum`` source can
  read ``M`` directly (``L ~ M M^T``, ``R ~ M^T M``). This equals storing ``M~`` and rotating
  it exactly at a refresh, since the map is linear.
* The second moment ``V~`` lives in the rotated basis. At a refresh from ``(U, V)`` to
  ``(U', V')`` it is carried over as the diagonal of the old diagonal second moment seen in
  the new basis: with ``P = U'^T U`` and ``Q = V^T V'``,
  ``V~' = (P o P) V~ (Q o Q)`` (``o`` the element-wise product). It is exact when the old
  rotated coordinates are uncorrelated, keeps ``V~ >= 0``, and is the identity when the
  basis does not change.
* ``L``, ``R`` are EMAs with ``beta2`` (Adam's second-moment decay), updated every step.
* A refresh is one power-iteration step plus QR, ``U' = qr(L U)`` (float64, columns'
  signs fixed so that ``diag(R_qr) >= 0``), run *after* the step whose local step count
  triggers it; it is skipped while ``L U`` is zero or not finite (no statistics yet). The
  initial basis is the identity, so refresh interval 0 is exactly AdamW.
* With the ``momentum`` source the larger side of a non-square weight has a rank-deficient
  statistic (``M^T M`` of an m x n ``M``, m < n, has rank m): its eigenvectors are fixed only
  on the range. The power step runs on ``S + c (I - Q Q^T)`` instead (``Q`` the range and
  ``c = trace(S) / rank``, both from one SVD of ``M``: :class:`MomentumRanges`,
  :func:`full_rank_statistic`), which has exactly ``S``'s
  eigenvectors, so the paper's "eigenvectors of ``M^T M``" still hold, while the null-space
  columns continue the old basis's directions instead of being set by rounding. The
  second-moment statistics are EMAs of ``G G^T`` over steps and reach full rank after a few
  steps; they are used as they are.
* What is rotated: 2-D parameters except those whose rows are tokens or positions (the
  embeddings and the untied output layer): their gradient is row-sparse or dominated by
  frequent tokens, a vocabulary-sized rotation mixes unrelated tokens, and the convergence
  study (``docs/convergence.md``) measured that rotating the output layer makes training slower
  than AdamW even without delay. Of a 2-D parameter only sides of at most
  :data:`MAX_ROTATED_DIM` are rotated; everything else runs plain AdamW.
* Stage-aware refresh (see :func:`refresh_rate`): stage ``s`` of ``N`` refreshes at rate
  ``r_s = (1/k) * (tau_s + 1) / mean(tau + 1)`` with expected delay ``tau_s = N - 1 - s``,
  i.e. ``r_s = 2 (N - s) / (k (N + 1))``; the sum over stages equals the uniform budget
  ``N / k`` exactly. Stage ``s`` refreshes at local step ``t`` when ``floor(t r_s)``
  increases; rates above one refresh per step are capped at 1 (only possible for ``k = 1``).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import Tensor
from torch.nn import Parameter

from megatron.trainer.config.basis_rotation_args import GEOMETRIES, SOURCES
from megatron.trainer.optim.adamw import NoDecayFn, StageAdamW
from megatron.trainer.optim.adamw_slots import Slot as _Slot

# Sides longer than this are not rotated (an m x m basis plus its statistics would cost
# more memory than the weight itself for, e.g., a vocabulary-sized output layer).
MAX_ROTATED_DIM = 8192
# Parameters indexed by token or position run AdamW (megatron-core's names).
VOCABULARY_PARAMETERS = ("embedding", "output_layer")


@dataclass(frozen=True)
class RotationConfig:
    """How bases are estimated and how often they are refreshed on one pipeline stage."""

    geometry: str = "bilateral"
    source: str = "second-moment"
    refresh_interval: int = 10  # k; 0: never (identity basis, i.e. AdamW)
    stage_aware: bool = False
    stage: int = 0
    num_stages: int = 1

    def __post_init__(self) -> None:
        if self.geometry not in GEOMETRIES:
            raise ValueError(f"rotation geometry must be one of {GEOMETRIES}, got {self.geometry!r}")
        if self.source not in SOURCES:
            raise ValueError(f"rotation source must be one of {SOURCES}, got {self.source!r}")
        if self.refresh_interval < 0:
            raise ValueError(f"rotation refresh interval must be >= 0, got {self.refresh_interval}")
        if not 0 <= self.stage < self.num_stages:
            raise ValueError(f"stage {self.stage} outside 0..{self.num_stages - 1}")


def refresh_rate(config: RotationConfig) -> Fraction:
    """Refreshes per local step of ``config.stage`` (an exact fraction, capped at 1).

    Uniform: ``1/k``. Stage-aware: ``2 (N - s) / (k (N + 1))``, proportional to the stage's
    expected delay plus one (``tau_s = N - 1 - s``; the +1 keeps the last, delay-free stage
    refreshing), normalised so that the rates of all stages sum to ``N / k``.
    """
    k, n, s = config.refresh_interval, config.num_stages, config.stage
    if k == 0:
        return Fraction(0)
    rate = Fraction(2 * (n - s), k * (n + 1)) if config.stage_aware else Fraction(1, k)
    return min(rate, Fraction(1))


def refreshes_at(config: RotationConfig, step: int) -> bool:
    """Whether local step ``step`` (1-based, after its update) ends with a basis refresh."""
    rate = refresh_rate(config)
    return step >= 1 and math.floor(step * rate) > math.floor((step - 1) * rate)


def carry_second_moment(exp_avg_sq: Tensor, old_u: Tensor | None, new_u: Tensor | None,
                        old_v: Tensor | None, new_v: Tensor | None) -> Tensor:
    """``(P o P) V~ (Q o Q)`` with ``P = U'^T U``, ``Q = V^T V'`` (None: identity side).

    The second moment of ``G~' = P G~ Q`` when the old rotated coordinates are uncorrelated:
    ``E[G~'_ab^2] = sum_ij P_ai^2 E[G~_ij^2] Q_jb^2``.
    """
    out = exp_avg_sq
    if new_u is not None:
        p = new_u.T @ old_u if old_u is not None else new_u.T
        out = p.square() @ out
    if new_v is not None:
        q = old_v.T @ new_v if old_v is not None else new_v
        out = out @ q.square()
    return out


@dataclass(frozen=True)
class MomentumRanges:
    """The ranges of ``M M^T`` (``rows``, m x r) and ``M^T M`` (``cols``, n x r) from one SVD of
    the momentum ``M`` (float64), and ``fill = trace(M M^T) / r``, their mean nonzero eigenvalue
    (``r``: the numerical rank; None when ``M`` is zero)."""

    rows: Tensor
    cols: Tensor
    fill: Tensor

    @staticmethod
    def of(momentum: Tensor) -> MomentumRanges | None:
        left, sigma, right_t = torch.linalg.svd(momentum.double(), full_matrices=False)
        if sigma.numel() == 0 or not bool(sigma[0] > 0):
            return None
        eps = torch.finfo(momentum.dtype).eps
        rank = int((sigma > eps * max(momentum.shape) * sigma[0]).sum())
        return MomentumRanges(left[:, :rank], right_t[:rank].T, sigma[:rank].square().sum() / rank)


def full_rank_statistic(stat: Tensor, span: Tensor, fill: Tensor) -> Tensor:
    """``S + fill (I - Q Q^T)`` (``Q = span``, the range of ``S``): full rank, with ``S``'s eigenvectors.

    Why: with the momentum source ``S = M M^T`` or ``M^T M``, and on the larger side of a
    non-square ``M`` (m x n, m < n) ``M^T M`` has rank m < n: its eigenvectors are only
    determined on the m-dimensional range, the rest is a null space in which *any* orthonormal
    basis is an eigenbasis. A power step ``S V`` has no component there, so QR would fill those
    columns from rounding noise (different in every implementation, and unstable from one
    refresh to the next). The paper asks for eigenvectors of ``S``; adding ``fill`` times the
    projector onto the null space changes no eigenvector of ``S`` and gives the null space the
    mean nonzero eigenvalue, so the power step keeps the old basis's null-space directions
    (projected and re-orthogonalised) at a scale QR resolves exactly. ``S`` is returned
    unchanged when it has full rank.
    """
    dim = stat.shape[0]
    if span.shape[1] >= dim:
        return stat
    projector = torch.eye(dim, dtype=stat.dtype, device=stat.device) - span @ span.T
    return stat + fill * projector


def _power_qr(stat: Tensor, basis: Tensor | None, span: Tensor | None = None,
              fill: Tensor | None = None) -> Tensor | None:
    """One power-iteration step and QR, in float64; None when ``stat`` carries no signal.
    With ``span`` (the range of ``stat``) a rank-deficient ``stat`` is first completed by
    :func:`full_rank_statistic`."""
    s = stat.double()
    if span is not None and fill is not None:
        s = full_rank_statistic(s, span, fill)
    product = s if basis is None else s @ basis.double()
    if not bool(torch.isfinite(product).all()) or not bool(product.any()):
        return None
    q, r = torch.linalg.qr(product)
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return (q * signs).to(stat.dtype)


class _Rotation:
    """Per-parameter rotation state: bases (None: identity) and their statistics."""

    def __init__(self, reference: Tensor, rotate_rows: bool, rotate_cols: bool, keep_stats: bool) -> None:
        m, n = reference.shape
        zeros = lambda k: torch.zeros(k, k, dtype=reference.dtype, device=reference.device)
        self.device = reference.device
        self.rotate_rows, self.rotate_cols = rotate_rows, rotate_cols
        self.u: Tensor | None = None
        self.v: Tensor | None = None
        self.left = zeros(m) if keep_stats and rotate_rows else None
        self.right = zeros(n) if keep_stats and rotate_cols else None

    @property
    def identity(self) -> bool:
        return self.u is None and self.v is None

    def to_rotated(self, x: Tensor) -> Tensor:
        """``U^T x V`` (identity sides skipped)."""
        if self.u is not None:
            x = self.u.T @ x
        if self.v is not None:
            x = x @ self.v
        return x

    def from_rotated(self, x: Tensor) -> Tensor:
        """``U x V^T`` (identity sides skipped)."""
        if self.u is not None:
            x = self.u @ x
        if self.v is not None:
            x = x @ self.v.T
        return x

    def state(self) -> dict[str, Tensor | None]:
        return {k: (None if t is None else t.clone())
                for k, t in (("u", self.u), ("v", self.v), ("left", self.left), ("right", self.right))}


class BasisRotationAdamW(StageAdamW):
    """StageAdamW whose 2-D weights run Adam in a periodically refreshed rotated basis.

    Everything outside the per-parameter Adam arithmetic (grad scaling and clipping,
    decoupled weight decay, fp32 masters, ``p.data`` writes, grad norms, zero_grad) is
    StageAdamW's. Rollback (optimizer post-validation) is not supported: inverting a step
    would also have to undo statistics and refreshes.
    """

    def __init__(
        self,
        params: Iterable[tuple[str, Parameter]],
        lr: float,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        no_decay_fn: NoDecayFn | None = None,
        rotation: RotationConfig = RotationConfig(),
    ) -> None:
        super().__init__(params, lr, weight_decay, betas, eps, no_decay_fn, exact=False)
        self.rotation = rotation
        keep_stats = rotation.source == "second-moment" and refresh_rate(rotation) > 0
        self._rotations: dict[str, _Rotation] = {}
        for slot in self._slots:
            sides = self._rotated_sides(slot)
            if sides is not None:
                self._rotations[slot.name] = _Rotation(slot.exp_avg, *sides, keep_stats=keep_stats)

    def _rotated_sides(self, slot: _Slot) -> tuple[bool, bool] | None:
        """(rotate rows, rotate columns) for ``slot``, or None when it runs plain AdamW."""
        if slot.param.ndim != 2 or any(part in slot.name for part in VOCABULARY_PARAMETERS):
            return None
        m, n = slot.param.shape
        rows, cols = m <= MAX_ROTATED_DIM, n <= MAX_ROTATED_DIM
        if self.rotation.geometry == "unilateral":
            rows, cols = rows and m <= n, cols and n < m
        return (rows, cols) if rows or cols else None

    @property
    def rotated_names(self) -> frozenset[str]:
        """Parameters whose Adam runs in a rotated basis (for logging and tests)."""
        return frozenset(self._rotations)

    def basis(self, name: str) -> tuple[Tensor | None, Tensor | None]:
        """(U, V) of ``name`` (None: identity side)."""
        rot = self._rotations[name]
        return rot.u, rot.v

    # ------------------------------------------------------------------- step

    def step(self, lr: float, grad_scale: float = 1.0, grads_disposable: bool = False) -> None:
        """StageAdamW's step, then a basis refresh when this local step calls for one."""
        super().step(lr, grad_scale, grads_disposable)
        if self._rotations and refreshes_at(self.rotation, self.step_count):
            with torch.no_grad():
                for slot in self._slots:
                    if slot.name in self._rotations:
                        self._refresh(self._rotations[slot.name], slot)

    def _adam_update(self, slot: _Slot, target: Tensor, grad: Tensor, step_size: float,
                     bias_correction2_sqrt: float) -> None:
        """Adam in the slot's rotated basis; StageAdamW's arithmetic while it is the identity."""
        rot = self._rotations.get(slot.name)
        if rot is None:
            super()._adam_update(slot, target, grad, step_size, bias_correction2_sqrt)
            return
        beta1, beta2 = self.betas
        if rot.left is not None:
            rot.left.lerp_(grad @ grad.T, 1 - beta2)
        if rot.right is not None:
            rot.right.lerp_(grad.T @ grad, 1 - beta2)
        if rot.identity:
            super()._adam_update(slot, target, grad, step_size, bias_correction2_sqrt)
            return
        slot.exp_avg.lerp_(grad, 1 - beta1)
        rotated = rot.to_rotated(grad)
        slot.exp_avg_sq.mul_(beta2).addcmul_(rotated, rotated, value=1 - beta2)
        denom = (slot.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
        target.add_(rot.from_rotated(rot.to_rotated(slot.exp_avg) / denom), alpha=-step_size)

    def _refresh(self, rot: _Rotation, slot: _Slot) -> None:
        """New bases by one power step + QR; the second moment is carried into them."""
        m = slot.exp_avg
        new_u = new_v = None
        if self.rotation.source == "momentum":
            ranges = MomentumRanges.of(m) if bool(torch.isfinite(m).all()) else None
            if ranges is None:  # no signal yet (or a non-finite momentum): keep the bases
                return
            if rot.rotate_rows:
                new_u = _power_qr(m @ m.T, rot.u, ranges.rows, ranges.fill)
            if rot.rotate_cols:
                new_v = _power_qr(m.T @ m, rot.v, ranges.cols, ranges.fill)
        else:
            if rot.rotate_rows:
                new_u = _power_qr(rot.left, rot.u)
            if rot.rotate_cols:
                new_v = _power_qr(rot.right, rot.v)
        new_u = rot.u if new_u is None else new_u
        new_v = rot.v if new_v is None else new_v
        if new_u is rot.u and new_v is rot.v:
            return
        slot.exp_avg_sq.copy_(carry_second_moment(slot.exp_avg_sq, rot.u, new_u if new_u is not rot.u else None,
                                                  rot.v, new_v if new_v is not rot.v else None))
        rot.u, rot.v = new_u, new_v

    def rollback(self, lr: float, grad_scale: float = 1.0) -> None:
        raise NotImplementedError(
            "BasisRotationAdamW.rollback: optimizer post-validation is not supported with "
            "--optimizer basis-rotation (a rollback would also have to undo basis statistics and refreshes)")

    # ------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        """StageAdamW's snapshot plus every rotated parameter's bases and statistics."""
        sd = super().state_dict()
        sd["rotation"] = {name: rot.state() for name, rot in self._rotations.items()}
        sd["rotation_config"] = {"geometry": self.rotation.geometry, "source": self.rotation.source}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Restore a :meth:`state_dict` snapshot exactly (bases, statistics, moments)."""
        saved = sd.get("rotation")
        if saved is None:
            raise ValueError("BasisRotationAdamW.load_state_dict: the checkpoint has no basis-rotation state "
                             "(saved with another --optimizer?)")
        mine = {"geometry": self.rotation.geometry, "source": self.rotation.source}
        if sd.get("rotation_config") != mine:
            raise ValueError(f"BasisRotationAdamW.load_state_dict: checkpoint rotation {sd.get('rotation_config')}, "
                             f"this run {mine}")
        if set(saved) != set(self._rotations):
            raise ValueError("BasisRotationAdamW.load_state_dict: rotated parameters differ from the checkpoint's")
        for name, rot in self._rotations.items():
            _load_rotation(name, rot, saved[name])
        super().load_state_dict(sd)


def _load_rotation(name: str, rot: _Rotation, entry: dict[str, Tensor | None]) -> None:
    """Copy one parameter's saved bases and statistics (checked against this run's shapes)."""
    for key in ("left", "right"):
        live, value = getattr(rot, key), entry[key]
        if (live is None) != (value is None) or (live is not None and live.shape != value.shape):
            raise ValueError(f"BasisRotationAdamW.load_state_dict: {key} statistics mismatch for {name}")
        if live is not None:
            live.copy_(value)
    for key, allowed in (("u", rot.rotate_rows), ("v", rot.rotate_cols)):
        value = entry[key]
        if value is not None and not allowed:
            raise ValueError(f"BasisRotationAdamW.load_state_dict: unexpected basis {key} for {name}")
        setattr(rot, key, None if value is None else value.to(device=rot.device, copy=True))
