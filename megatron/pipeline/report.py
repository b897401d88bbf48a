"""Per-stage statistics over a logging interval, in a form any executor can ship.

The distributed runtime sends these as a fixed-length float64 tensor over a side channel
to the logging rank; the emulator hands the objects over directly. Both log the same.
"""
from __future__ import annotations

import math
from dataclasses import astuple, dataclass, fields

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
    aux_loss_sum: float = 0.0  # a task's logged part of the loss (BERT's sentence order), last stage
    aux_loss_count: int = 0

    @property
    def drift_mean(self) -> float:
        return self.drift_sum / self.drift_count if self.drift_count else 0.0

    @property
    def loss(self) -> float:
        return self.loss_sum / self.loss_count if self.loss_count else math.nan

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([float(v) for v in astuple(self)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "StageReport":
        values = t.tolist()
        kwargs = {}
        for f, v in zip(fields(cls), values):
            kwargs[f.name] = int(v) if f.type in ("int", int) else float(v)
        return cls(**kwargs)

    @classmethod
    def size(cls) -> int:
        return len(fields(cls))
