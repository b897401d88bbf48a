"""Per-stage peak memory of a candidate: static state plus the schedule's activation peak.

One model of the static bytes for the planner and the launcher's up-front per-rank estimate
(:mod:`megatron.trainer.launch.memory_estimate` builds its weights, gradients and optimizer
state with :func:`stage_memory`, and its part sizes with the planner's
:func:`~megatron.pipeline.costs.stages.part_parameters` /
:func:`~megatron.pipeline.costs.stages.part_activation_bytes`). They differ where their jobs
do: the planner takes the schedule's activation peak simulated with the candidate's costs; the
estimate takes unit-cost in-flight counts, adds the backward's working set, the loss's logits
copies and the process baseline, and scales CPU activations by the host heap factor.

Static bytes per parameter (the runtime's accounting, :mod:`megatron.pipeline.costs.cost_model`):
the parameter and its gradient (``2 x param_bytes``: fp32, or 16-bit with ``--bf16``), the two
fp32 AdamW moments (8) and, for 16-bit parameters, the fp32 master (4); the distributed
optimizer divides the last two terms by the data-parallel size. A schedule that keeps weight
versions beside the live ones (PipeDream-2BW's stash, PipeMare's velocity:
``Schedule.weight_copies``) adds one parameter-sized copy each; AMDP's copies are its hosted
replicas' parts, which are already counted part by part.

Activations: the simulator's per-stage peak in units of ``M_B`` times the stage's ``M_B`` in
bytes (:func:`~megatron.pipeline.costs.stages.stage_activation_unit`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

GB = 1e9  # memory is reported in decimal GB, the unit of a datasheet's "80 GB"


@dataclass(frozen=True)
class StageMemory:
    """Bytes of one stage at its peak."""

    weights: float  # parameters, extra weight copies included
    gradients: float
    optimizer: float  # moments and masters (sharded as requested)
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations

    @property
    def total_gb(self) -> float:
        return self.total / GB


def optimizer_bytes_per_param(param_bytes: int) -> float:
    """AdamW's two fp32 moments, plus an fp32 master copy of 16-bit parameters."""
    return 8.0 + (4.0 if param_bytes < 4 else 0.0)


def stage_memory(params: float, param_bytes: int, extra_weight_copies: float, optimizer_shards: int,
                 activation_peak_units: float, activation_unit_bytes: float) -> StageMemory:
    """One stage's peak (module docstring): ``params`` of its parts, ``optimizer_shards`` the
    replicas the optimizer state is divided over (1 without the distributed optimizer)."""
    return StageMemory(
        weights=params * param_bytes * (1.0 + extra_weight_copies),
        gradients=params * param_bytes,
        optimizer=params * optimizer_bytes_per_param(param_bytes) / optimizer_shards,
        activations=activation_peak_units * activation_unit_bytes,
    )


def fits(memory: Sequence[StageMemory], device_bytes: float | None) -> bool:
    """Whether every stage's peak fits the device (None: no limit given)."""
    return device_bytes is None or all(m.total <= device_bytes for m in memory)
