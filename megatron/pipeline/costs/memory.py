"""Per-stage peak memory of a candidate: static state plus the schedule's activation peak.

One model of the static bytes for the planner and the launcher's up-front per-rank estimate
(:mod:`megatron.trainer.plan.memory_estimate` builds its weights, gradients and optimizer
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
MIB = 2 ** 20  # the launcher's estimate is reported in MiB, as RSS is


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


@dataclass(frozen=True)
class RankMemory:
    """One rank's peak bytes by component (a rank of pipeline stage ``stage``): the launcher's
    up-front estimate (:mod:`megatron.trainer.plan.memory_estimate`), which adds the process
    baseline and the loss's logits to :class:`StageMemory`'s parts."""

    stage: int
    parameters: int  # this rank's share (tensor-parallel shard)
    weights: float
    gradients: float
    optimizer: float  # moments and fp32 masters
    activations: float  # peak in flight plus the backward's working set
    logits: float  # the loss backward's transient logits copies (last stage)
    baseline: float
    in_flight: float = 0.0  # the schedule's peak micro-batches in flight on the stage
    per_microbatch: float = 0.0  # the activation bytes of one more micro-batch in flight

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.baseline


@dataclass(frozen=True)
class MemoryEstimate:
    """Every stage's rank estimate, for one data-parallel, tensor-parallel replica."""

    stages: tuple[RankMemory, ...]
    device: str  # "cpu" or "cuda"

    @property
    def peak_rank(self) -> RankMemory:
        return max(self.stages, key=lambda s: s.total)

    def ranks_total(self, stages: list[int]) -> float:
        """Bytes of the ranks of ``stages`` (a stage listed twice counts twice)."""
        return sum(self.stages[s].total for s in stages)

    def banner_line(self) -> str:
        """One line: each stage's rank estimate (MiB) and the largest rank's parts."""
        per = ", ".join(f"{s.total / MIB:,.0f}" for s in self.stages)
        top = self.peak_rank
        parts = " + ".join(f"{name} {value / MIB:,.0f}" for name, value in (
            ("weights", top.weights), ("grads", top.gradients), ("optimizer", top.optimizer),
            ("activations", top.activations), ("logits", top.logits), ("baseline", top.baseline)))
        return f"memory per rank (estimate, MiB, {self.device}) per stage: [{per}] | stage {top.stage}: {parts}"
