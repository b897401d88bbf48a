"""Per-stage statistics over a logging interval, in a form any executor can ship.

The distributed runtime sends these as a fixed-length float64 tensor over a side channel
to the logging rank; the emulator hands the objects over directly. Both log the same.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch


@dataclass
class StageReport:
    """What one stage did between two logged updates."""

    stage: int
    update: int  # index of the last local update in the interval (0-based)
    updates: int  # updates attempted in the interval
    skipped: int  # of which skipped (non-finite gradients)
    loss_sum: float  # sum of micro-batch losses (last stage only)
    loss_count: int  # micro-batches that contributed to loss_sum
    tokens: int  # tokens whose loss counted (last stage only)
    lr: float  # learning rate of the last update
    grad_norm: float  # gradient norm the last update used (stage-local or global)
    drift_max: int  # max weight-version drift of a backward in the interval
    drift_sum: int  # for the mean
    drift_count: int
    act_peak_count: int  # max micro-batches with live activations at once
    act_peak_bytes: int  # max bytes of saved activations at once
    mem_peak_bytes: int  # device peak allocated (CUDA) or 0
    loss_scale: float = 1.0  # fp16: the stage's loss scale at the report
    param_sq: float = 0.0  # sum of squared parameters at the report (--log-params-norm), else 0
    aux_loss_sum: float = 0.0  # a task's logged part of the loss (BERT's sentence order), last stage
    aux_loss_count: int = 0

    @property
    def drift_mean(self) -> float:
        return self.drift_sum / self.drift_count if self.drift_count else 0.0

    @property
    def loss(self) -> float:
        return self.loss_sum / self.loss_count if self.loss_count else math.nan

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([float(getattr(self, name)) for name, _ in _FIELDS], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "StageReport":
        return cls(**{name: kind(v) for (name, kind), v in zip(_FIELDS, t.tolist())})

    @classmethod
    def size(cls) -> int:
        return len(_FIELDS)


# (name, int or float) of every field, computed once: ``dataclasses.fields()`` builds its tuple
# from a generator, and CPython keeps each such tuple on a free list when it is freed (up to
# 2000 per size), so calling it per report grows a rank's memory for thousands of iterations.
_FIELDS: tuple[tuple[str, type], ...] = tuple(
    (f.name, int if f.type in ("int", int) else float) for f in fields(StageReport))
