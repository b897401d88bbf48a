"""An independent numpy float64 re-derivation of basis-rotation AdamW for one 2-D weight
(``../shared/papers/basis_rotation.txt`` next to the repository, with the choices the
project documents in ``megatron/trainer/optim/basis_rotation.py``), written from the formulas, not
from the project's code:

* decoupled weight decay ``W *= 1 - lr wd``, then Adam with bias corrections on the rotated
  gradient ``G~ = U^T G V``: ``M`` (original basis) ``<- b1 M + (1 - b1) G``,
  ``V~ <- b2 V~ + (1 - b2) G~^2``, ``W -= lr / (1 - b1^t) * U (U^T M V / (sqrt(V~ / (1 - b2^t)) + eps)) V^T``;
* statistics ``L = EMA_b2(G G^T)``, ``R = EMA_b2(G^T G)`` (second-moment source) or
  ``M M^T``, ``M^T M`` (momentum source);
* every ``k``-th step ends with a refresh: ``U' = qr(S U)`` with ``diag(R_qr) >= 0``, where
  ``S`` is the side's statistic; for the momentum source on a side where ``S`` is rank
  deficient, ``S`` is first made full rank with the same eigenvectors by adding the mean
  nonzero eigenvalue times the projector onto its null space (computed here from a QR of
  the momentum's transposed factor, not from an SVD);
* the second moment is carried into the new basis as ``(P o P) V~ (Q o Q)``,
  ``P = U'^T U``, ``Q = V^T V'``.
"""
from __future__ import annotations

import numpy as np


def _signed_qr(a: np.ndarray) -> np.ndarray:
    q, r = np.linalg.qr(a)
    signs = np.sign(np.diag(r))
    signs[signs == 0] = 1.0
    return q * signs


def _completed(stat: np.ndarray, factor: np.ndarray) -> np.ndarray:
    """``stat = factor factor^T`` made full rank on its null space (factor of full column rank)."""
    dim, rank = factor.shape
    if rank >= dim:
        return stat
    span = _signed_qr(factor)  # orthonormal basis of the range
    return stat + np.trace(stat) / rank * (np.eye(dim) - span @ span.T)


class RotatedAdamW:
    """One weight ``w`` (m x n) under basis-rotation AdamW; ``rows``/``cols``: rotated sides."""

    def __init__(self, w: np.ndarray, wd: float, betas: tuple[float, float], eps: float, source: str,
                 rows: bool, cols: bool, interval: int):
        m, n = w.shape
        self.w, self.wd, (self.b1, self.b2), self.eps = w.copy(), wd, betas, eps
        self.source, self.rows, self.cols, self.interval = source, rows, cols, interval
        self.u, self.v = np.eye(m), np.eye(n)
        self.left, self.right = np.zeros((m, m)), np.zeros((n, n))
        self.mom, self.sq = np.zeros((m, n)), np.zeros((m, n))
        self.t = 0

    def step(self, grad: np.ndarray, lr: float) -> None:
        self.t += 1
        self.w *= 1 - lr * self.wd
        self.left += (1 - self.b2) * (grad @ grad.T - self.left)
        self.right += (1 - self.b2) * (grad.T @ grad - self.right)
        self.mom += (1 - self.b1) * (grad - self.mom)
        rotated = self.u.T @ grad @ self.v
        self.sq = self.b2 * self.sq + (1 - self.b2) * rotated ** 2
        denom = np.sqrt(self.sq) / np.sqrt(1 - self.b2 ** self.t) + self.eps
        update = self.u @ ((self.u.T @ self.mom @ self.v) / denom) @ self.v.T
        self.w -= lr / (1 - self.b1 ** self.t) * update
        if self.interval and self.t % self.interval == 0:
            self._refresh()

    def _refresh(self) -> None:
        momentum = self.source == "momentum"
        new_u, new_v = self.u, self.v
        if self.rows:
            stat = _completed(self.mom @ self.mom.T, self.mom) if momentum else self.left
            new_u = _signed_qr(stat @ self.u)
        if self.cols:
            stat = _completed(self.mom.T @ self.mom, self.mom.T) if momentum else self.right
            new_v = _signed_qr(stat @ self.v)
        p, q = new_u.T @ self.u, self.v.T @ new_v
        self.sq = (p ** 2) @ self.sq @ (q ** 2)
        self.u, self.v = new_u, new_v
