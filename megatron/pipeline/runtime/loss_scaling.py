"""fp16 loss scaling for one pipeline stage: megatron-core's scalers, per stage, on any device.

Megatron-LM's rules are those of megatron-core's ``DynamicGradScaler`` (reused here, not
re-implemented: only its constructor is replaced, because it puts the scale on ``cuda``) and
``ConstantGradScaler`` for ``--loss-scale``. Every stage worker owns one :class:`StageLossScaler`;
what differs between schedules is which found-inf flag drives it and how gradients travel:

* **pipeline-wide** (synchronous schedules): every stage's scaler is updated with the *global*
  non-finite flag (the sum of all stages' squared norms that the step already gathers), so all
  scalers stay in lock-step and hold one scale. The last stage multiplies the loss by it; the
  gradients crossing stage boundaries are fp16 and carry that scale.
* **stage-local** (asynchronous schedules): each stage's scaler is updated with the flag of the
  gradients that stage steps with, on its own optimizer clock. A stage multiplies the gradient
  it receives by *its own* scale before its backward (the last stage: its loss) and sends its
  input gradient *unscaled*, in fp32. So the scale in a stage's weight gradients is always its
  own, and constant between two of its steps (it only changes at them), whatever scale other
  stages used for the same micro-batch. Scales are powers of two by default, so unscaling in
  fp32 is exact and a transit costs nothing but twice the bytes of an fp16 gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler


@dataclass(frozen=True)
class LossScaleConfig:
    """Megatron-LM's flags: ``--loss-scale`` (static) or the dynamic scaler's parameters."""

    static_scale: float | None = None
    initial_scale: float = 2.0**32
    min_scale: float = 1.0
    window: int = 1000  # --loss-scale-window: clean steps before the scale doubles
    hysteresis: int = 2  # overflows (since the last growth) before the scale halves
    stage_local: bool = False  # asynchronous schedules: see the module docstring


class _CPUDynamicGradScaler(DynamicGradScaler):
    """megatron-core's ``DynamicGradScaler`` with its state on the CPU (its constructor and
    ``load_state_dict`` hard-code ``cuda``); ``update`` is megatron-core's own."""

    def __init__(self, config: LossScaleConfig) -> None:  # noqa: D107 - same checks as megatron's
        if not (0.0 < config.min_scale <= config.initial_scale):
            raise ValueError(f"loss scaling: need 0 < min scale {config.min_scale} <= initial {config.initial_scale}")
        if config.window < 1 or config.hysteresis < 1:
            raise ValueError("loss scaling: window and hysteresis must be >= 1")
        self._scale = torch.tensor([config.initial_scale], dtype=torch.float)
        self.min_scale = torch.tensor([config.min_scale], dtype=torch.float)
        self.growth_factor = torch.tensor([2.0], dtype=torch.float)
        self.backoff_factor = torch.tensor([0.5], dtype=torch.float)
        self.growth_interval = config.window
        self.hysteresis = config.hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = config.hysteresis

    def load_state_dict(self, state_dict: dict) -> None:
        self._scale = state_dict["scale"].detach().to("cpu", torch.float).clone()
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])


class _CPUConstantGradScaler(ConstantGradScaler):
    def __init__(self, scale: float) -> None:  # noqa: D107
        if not scale > 0.0:
            raise ValueError(f"--loss-scale must be > 0, got {scale}")
        self._scale = torch.tensor([scale], dtype=torch.float)


class StageLossScaler:
    """One stage's loss scale, as Python floats for the worker (no device sync per use)."""

    def __init__(self, config: LossScaleConfig) -> None:
        self.config = config
        self.stage_local = config.stage_local
        self._scaler: MegatronGradScaler = (
            _CPUConstantGradScaler(config.static_scale) if config.static_scale is not None
            else _CPUDynamicGradScaler(config))
        self._read()

    def _read(self) -> None:
        self.scale = float(self._scaler.scale)
        self.inv_scale = float(self._scaler.inv_scale)

    def update(self, found_inf: bool) -> None:
        """After a step decision: megatron-core's rule (skip counting, hysteresis, growth)."""
        self._scaler.update(found_inf)
        self._read()

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scaler.scale.clone(), **{k: v for k, v in self._scaler.state_dict().items()
                                                        if k != "scale"}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(self._scaler, DynamicGradScaler):
            self._scaler.load_state_dict(state)
        self._read()


__all__ = ["LossScaleConfig", "StageLossScaler"]
