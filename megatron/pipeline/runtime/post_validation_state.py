"""A stage's post-validation bookkeeping and the tensors its state messages travel as.

Why a module of its own: the stage worker holds this state and sizes the receive buffers of
PARTIAL_STATE / GLOBAL_STATE messages, while the ops that change it
(:mod:`megatron.pipeline.runtime.post_validation_ops`) drive the worker; keeping the state
here lets the worker import it without importing those ops, so neither imports the other.
The schedule half (streams, outcomes, decisions) is :mod:`megatron.pipeline.schedules.zero_bubble.post_validation`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron.pipeline.ir import PipelineLayout

#: The state is one squared norm per stage, summed in float64 like a synchronous step does
STATE_DTYPE = torch.float64


@dataclass
class PendingUpdate:
    """An update a stage stepped (or held back) at its PSTEP and has not validated yet."""

    update: int
    lr: float
    unscale: float  # the inverse loss scale the gradients are unscaled with (1.0 without fp16)
    stepped: bool
    sq_norms: list[float]  # the partial state this stage sent on (global on the last stage)
    rng: Any  # the stage's RNG state at the PSTEP (before the first pre-validation forward)


@dataclass
class PostValidationState:
    """A stage worker's post-validation bookkeeping (one pending update at a time)."""

    pending: PendingUpdate | None = None
    optimistic_steps: int = 0
    rollbacks: int = 0
    redos: int = 0
    reruns: int = 0
    log: list[dict[str, Any]] = field(default_factory=list)


def state_spec(layout: PipelineLayout) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of a PARTIAL_STATE / GLOBAL_STATE message."""
    return (layout.num_stages,), STATE_DTYPE


def state_tensor(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """The message carrying the per-stage squared norms ``values``."""
    return torch.tensor(list(values), dtype=STATE_DTYPE, device=device)


def state_values(tensor: torch.Tensor) -> list[float]:
    """The per-stage squared norms a received state message carries."""
    return [float(x) for x in tensor.tolist()]
