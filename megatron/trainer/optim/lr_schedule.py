"""Learning-rate schedule as a pure function of a stage's local step index.

In an asynchronous pipeline each stage steps its optimizer on its own clock,
so a scheduler object mutated by a global training loop (Megatron-LM's
``OptimizerParamScheduler``) does not fit; a pure ``lr(step)`` lets every stage
ask for the rate of the update it is about to apply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


@dataclass
class LRSchedule:
    """Megatron-LM's OptimizerParamScheduler lr rule as a pure function of the (local) step index.

    ``lr(n)`` returns exactly what Megatron's ``get_lr`` returns when its
    ``num_steps == n`` (with ``init_lr = 0``): linear warm-up
    ``max_lr * n / warmup_steps`` for ``n <= warmup_steps``, then the decay
    style, then ``min_lr`` for ``n > decay_steps``.

    Calling convention (differs from Megatron by one, on purpose): the trainer
    calls ``lr(step_count + 1)`` for the update about to be applied, i.e. the
    k-th update (1-based) uses ``lr(k)``.  Megatron applies the rate computed
    *before* incrementing ``num_steps``, so its first update uses ``lr(0) = 0``
    during warm-up, a wasted step; ours uses ``max_lr / warmup_steps`` and the
    ``warmup_steps``-th update is the first at ``max_lr``.

    ``decay_steps`` is normally ``train_iters`` (the trainer's default).  For
    ``WSD`` the last ``wsd_decay_steps`` steps before ``decay_steps`` anneal
    with ``wsd_decay_style``; earlier post-warm-up steps stay at ``max_lr``.
    """

    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    decay_style: str
    wsd_decay_steps: int = 0
    wsd_decay_style: str = "linear"

    def __post_init__(self) -> None:
        """Fail fast at construction with a one-line message, not with an assert mid-run.

        Fields are validated here only; build a new schedule (e.g. with
        ``dataclasses.replace``) rather than mutating one.
        """
        _validate(self)

    def lr(self, step: int) -> float:
        """Learning rate for local step ``step`` (the trainer passes ``step_count + 1``)."""
        if step < 0:
            raise ValueError(f"LRSchedule.lr: step must be >= 0, got {step}")
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.max_lr * float(step) / float(self.warmup_steps)
        if self.decay_style == "constant":
            return self.max_lr
        if step > self.decay_steps:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            return self._inverse_square_root(step)
        return self.min_lr + self._coeff(step) * (self.max_lr - self.min_lr)

    def _inverse_square_root(self, step: int) -> float:
        """``max_lr * sqrt(warmup / step)``, floored at ``min_lr`` (Megatron's rule)."""
        warmup = max(self.warmup_steps, 1)
        lr = self.max_lr * warmup**0.5 / (max(step, 1) ** 0.5)
        return max(self.min_lr, lr)

    def _coeff(self, step: int) -> float:
        """Fraction of ``max_lr - min_lr`` above ``min_lr`` after warm-up, in [0, 1]."""
        ratio = float(step - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            return 1.0 - ratio
        if self.decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self._wsd_coeff(step)

    def _wsd_coeff(self, step: int) -> float:
        """Warmup-stable-decay: 1 until the anneal window, then the WSD decay style."""
        anneal_start = self.decay_steps - self.wsd_decay_steps
        if step <= anneal_start:
            return 1.0
        ratio = float(step - anneal_start) / float(self.wsd_decay_steps)
        if self.wsd_decay_style == "linear":
            return 1.0 - ratio
        if self.wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if self.wsd_decay_style == "exponential":
            return 2.0 * math.pow(0.5, ratio) - 1.0
        return 1.0 - math.sqrt(ratio)


def _validate(s: LRSchedule) -> None:
    """Raise ValueError (one line) for arguments Megatron would reject or misuse."""
    if s.decay_style not in DECAY_STYLES:
        raise ValueError(f"LRSchedule: decay_style must be one of {DECAY_STYLES}, got {s.decay_style!r}")
    if not (s.min_lr >= 0.0 and s.max_lr >= 0.0):
        raise ValueError(f"LRSchedule: learning rates must be >= 0, got max_lr={s.max_lr} min_lr={s.min_lr}")
    if s.min_lr > s.max_lr:
        raise ValueError(f"LRSchedule: min_lr ({s.min_lr}) must be <= max_lr ({s.max_lr})")
    if s.warmup_steps < 0:
        raise ValueError(f"LRSchedule: warmup_steps must be >= 0, got {s.warmup_steps}")
    if s.decay_steps < 1:
        raise ValueError(f"LRSchedule: decay_steps must be >= 1, got {s.decay_steps}")
    if s.warmup_steps > s.decay_steps:
        raise ValueError(f"LRSchedule: warmup_steps ({s.warmup_steps}) must be <= decay_steps ({s.decay_steps})")
    if s.decay_style == "WSD":
        _validate_wsd(s)


def _validate_wsd(s: LRSchedule) -> None:
    """WSD needs a non-empty anneal window that lies after warm-up."""
    if s.wsd_decay_style not in WSD_DECAY_STYLES:
        raise ValueError(f"LRSchedule: wsd_decay_style must be one of {WSD_DECAY_STYLES}, got {s.wsd_decay_style!r}")
    if not 1 <= s.wsd_decay_steps <= s.decay_steps - s.warmup_steps:
        raise ValueError(
            f"LRSchedule: wsd_decay_steps must be in [1, decay_steps - warmup_steps], got {s.wsd_decay_steps}"
        )
