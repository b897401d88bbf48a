"""Which weights a stage's passes read, as data: the weight-policy specs schedules return.

Why specs and not the policies themselves: a schedule decides *which* weight versions its
forwards and backwards read (PipeDream-2BW's previous version, PipeMare's extrapolated
one), but keeping those versions means copying tensors, which is the runtime's job. So
a schedule's policy (:class:`~megatron.pipeline.schedules.policy.SchedulePolicy`) holds one of
these frozen dataclasses per stage (None: the live weights), which the schedule check, the simulator or a test
can inspect without torch, and
:func:`megatron.pipeline.runtime.weight_versions.build_weight_policy` turns it into the
implementation a stage worker plugs in. Each field is a parameter of that implementation.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DoubleBuffered:
    """PipeDream-2BW: window ``w`` runs forward and backward on version ``w - 1``.

    Implemented by :class:`megatron.pipeline.runtime.weight_versions.DoubleBufferedWeights`.
    """

    microbatches_per_update: int  # the accumulation window's length ``a``


@dataclass(frozen=True)
class DiscrepancyCorrected:
    """PipeMare's T2: a backward reads ``w - d * delta``, ``delta`` the decayed velocity.

    Implemented by :class:`megatron.pipeline.runtime.weight_versions.DiscrepancyCorrection`,
    whose docstring gives the formulas.
    """

    tau: int  # the stage's forward/backward delay in updates (>= 1)
    decay: float  # D: ``delta`` decays by ``D ** (1 / tau)`` per update
    microbatches_per_update: int
    sync_until: int = 0  # backwards of iterations below this are not corrected (sync warm-up)
    measured_delay: bool = False  # d = the updates really applied since the forward, not tau


#: What ``SchedulePolicy.weight_policies`` holds for a stage that does not read its live weights
WeightPolicySpec = DoubleBuffered | DiscrepancyCorrected

#: ``SchedulePolicy.fixed_accumulation`` of a schedule whose weight versions are counted in
#: micro-batches per update (2BW's stash, PipeMare's delay and correction)
COUNTED_WEIGHT_VERSIONS = "keeps weight versions counted in micro-batches per update"

__all__ = ["COUNTED_WEIGHT_VERSIONS", "DiscrepancyCorrected", "DoubleBuffered", "WeightPolicySpec"]
