"""Learning-rate schedule as a pure function of a stage's local step index.

The rule is megatron-core's: :class:`LRSchedule` holds one
``megatron.core.optimizer_param_scheduler.OptimizerParamScheduler`` per stage and asks its
``get_lr`` for the step in question, so constant, linear, cosine, inverse-square-root and WSD
(with its four anneal styles) are the pinned wheel's arithmetic, bit for bit.

What stays here, and why: in an asynchronous pipeline each stage steps its optimizer on its
own clock, while the core scheduler is a mutable object advanced by one global loop
(``step(increment)`` writes ``lr`` into an optimizer's ``param_groups``). So each stage gets its
own core scheduler over a parameter-free stand-in optimizer, and :meth:`LRSchedule.lr` sets
that scheduler's ``num_steps`` to the stage's step before asking: a stage reads the rate of
the update it is about to apply, whatever the other stages' clocks say. The checks stay too:
the core asserts mid-construction where we refuse with one line at the argument parser, and
it refuses a run that is all warm-up (``warmup_steps == decay_steps``), which is valid here
(its warm-up length is therefore given to the scheduler after construction; ``get_lr`` reads
it on every call).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.trainer.config.choices import DECAY_STYLES, WSD_DECAY_STYLES



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

    _core: OptimizerParamScheduler = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Fail fast at construction with a one-line message, not with an assert mid-run.

        Fields are checked here only; build a new schedule (e.g. with
        ``dataclasses.replace``) rather than mutating one.
        """
        _check(self)
        self._core = OptimizerParamScheduler(
            SimpleNamespace(param_groups=[]), init_lr=0.0, max_lr=self.max_lr, min_lr=self.min_lr,
            lr_warmup_steps=0, lr_decay_steps=self.decay_steps, lr_decay_style=self.decay_style,
            start_wd=0.0, end_wd=0.0, wd_incr_steps=1, wd_incr_style="constant",
            wsd_decay_steps=self.wsd_decay_steps, lr_wsd_decay_style=self.wsd_decay_style)
        self._core.lr_warmup_steps = self.warmup_steps  # see the module docstring

    def lr(self, step: int) -> float:
        """Learning rate for local step ``step`` (the trainer passes ``step_count + 1``)."""
        if step < 0:
            raise ValueError(f"LRSchedule.lr: step must be >= 0, got {step}")
        self._core.num_steps = step
        return float(self._core.get_lr({}))


def _check(s: LRSchedule) -> None:
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
        _check_wsd(s)


def _check_wsd(s: LRSchedule) -> None:
    """WSD needs a non-empty anneal window that lies after warm-up."""
    if s.wsd_decay_style not in WSD_DECAY_STYLES:
        raise ValueError(f"LRSchedule: wsd_decay_style must be one of {WSD_DECAY_STYLES}, got {s.wsd_decay_style!r}")
    if not 1 <= s.wsd_decay_steps <= s.decay_steps - s.warmup_steps:
        raise ValueError(
            f"LRSchedule: wsd_decay_steps must be in [1, decay_steps - warmup_steps], got {s.wsd_decay_steps}"
        )
