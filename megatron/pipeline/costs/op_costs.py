"""Per-op costs of a stage: what the timing simulator, the schedulers and the planner read.

:class:`OpCosts` holds one stage's times (any unit) and activation-memory ratios (units of
``M_B``, the activations one micro-batch keeps on a stage for its backward); the accounting
that uses them is described in :mod:`megatron.pipeline.simulator`. ``m_w = M_W / M_B``, what a
split backward (B) keeps until its W, is defined here in two named values, each with its
reason: :data:`REFERENCE_M_W` (``OpCosts()``, the papers' units) and :data:`UNPROFILED_M_W`
(what a run assumes until its costs are known: the command line and the placeholder costs).
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from megatron.pipeline.comm import op_sends
from megatron.pipeline.ir import Op, OpKind, PipelineLayout

#: ``OpCosts()``'s ``m_w``: the Zero Bubble reference scheduler's units (F = +2, B = -1, W = -1),
#: in which the papers' memory and bubble tables are stated and reproduced (tests/test_simulator.py,
#: tests/test_v_schedules.py). For costs that describe a model, give its ratio.
REFERENCE_M_W = 0.5
#: What a run assumes before its costs are profiled or given (``--zb-costs`` without M_W/M_B, the
#: placeholder costs of a profiled schedule): W keeps a micro-batch's activations entirely, the
#: most it can hold, so a memory limit holds in the runtime's own accounting whatever the
#: model's real ratio (memory after any prefix of ops grows with M_W / M_B, since every stage has
#: run at least as many B passes as W passes). The reference's 1/2 can underestimate badly: the
#: tiny GPTs of the tests keep 0.77-0.98 of M_B for W (no dropout).
UNPROFILED_M_W = 1.0

@dataclass(frozen=True)
class OpCosts:
    """Per-op costs of one stage (times in any unit, memory in units of ``M_B``).

    The default (``t_f = t_b = t_w = 1``, ``t_comm = 0``) is the Zero Bubble reference's
    placeholder before profiling; pass profiled times for real schedules.
    """

    t_f: float = 1.0
    t_b: float = 1.0
    t_w: float = 1.0
    t_bw: float | None = None  # fused backward; None means t_b + t_w
    t_comm: float = 0.0  # time from the end of a sending op to the arrival of its message
    t_opt: float = 0.0
    m_w: float = REFERENCE_M_W  # M_W / M_B: activation memory kept between B and W
    m_f: float = 1.0  # activation memory kept from F to B / M_B (< 1 with activation recompute)
    t_send: float = 0.0  # sender's time per message handed to the transport (isend call)
    t_sync: float = 0.0  # a synchronous OPT's collective latency, on top of t_opt

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and (not isinstance(v, (int, float)) or v < 0 or math.isnan(v)):
                raise ValueError(f"OpCosts.{f.name} must be a non-negative number, got {v!r}")
        if self.m_w > 1 or self.m_f > 1:
            raise ValueError(f"OpCosts.m_w = M_W / M_B and m_f must be <= 1, got {self.m_w}, {self.m_f}")

    @property
    def fused_backward(self) -> float:
        return self.t_b + self.t_w if self.t_bw is None else self.t_bw

    @property
    def sync_step(self) -> float:
        """Duration of this stage's part of a synchronous OPT: the step plus the collective."""
        return self.t_opt + self.t_sync

    def duration(self, kind: OpKind) -> float:
        if kind is OpKind.F:
            return self.t_f
        if kind is OpKind.B:
            return self.t_b
        if kind is OpKind.W:
            return self.t_w
        if kind is OpKind.BW:
            return self.fused_backward
        return self.t_opt

    def memory_delta(self, kind: OpKind) -> float:
        """Change of activation memory (units of M_B) when an op of ``kind`` finishes."""
        if kind is OpKind.F:
            return self.m_f
        if kind is OpKind.B:
            return self.m_w - self.m_f
        if kind is OpKind.W:
            return -self.m_w
        if kind is OpKind.BW:
            return -self.m_f
        return 0.0

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "OpCosts":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown cost field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**{k: (None if v is None else float(v)) for k, v in values.items()})


CostsLike = OpCosts | Sequence[OpCosts] | Mapping[str, Any] | None


def stage_mean(costs: Sequence[OpCosts], collective: float = 0.0) -> OpCosts:
    """A stage's costs from its parts': the mean per op; the step and the reduction over all of
    its parameters (their sums), the collective ``collective`` once."""
    n = len(costs)
    mean = {f: sum(getattr(c, f) for c in costs) / n for f in ("t_f", "t_b", "t_w", "t_comm", "t_send", "m_w", "m_f")}
    return OpCosts(**mean, t_opt=sum(c.t_opt for c in costs),
                   t_sync=sum(c.t_sync for c in costs) - (n - 1) * collective)


def priced_part(layout: PipelineLayout, op: Op) -> int:
    """Which entry of the per-stage costs (:func:`stage_costs`) prices ``op``: its model part
    where the layout splits the model into as many parts as stages (one chain, or AMDP's
    replicated pipelines, whose devices pay the logical stage they run), else its stage (a
    chunked layout's stage costs cover all its parts). The simulator's rule and the shared-core
    model's."""
    if layout.num_model_stages == layout.num_stages:
        return layout.model_stage(op.stage, op.chunk)
    return op.stage


def send_time(costs: OpCosts, op: Op, layout: PipelineLayout) -> float:
    """What handing ``op``'s messages to the transport costs its stage: ``t_send`` per message
    to another stage (a V's turn on its own stage sends nothing over the wire)."""
    if not costs.t_send:
        return 0.0
    return costs.t_send * sum(1 for msg in op_sends(op, layout) if msg.dst_stage != op.stage)


def stage_costs(costs: CostsLike, num_stages: int) -> tuple[OpCosts, ...]:
    """Normalise ``costs`` to one :class:`OpCosts` per stage.

    Accepts None (the default costs), one ``OpCosts`` for every stage, a sequence of one per
    stage, or a profile mapping as read from JSON (see :func:`costs_from_profile`).
    """
    if costs is None:
        return (OpCosts(),) * num_stages
    if isinstance(costs, OpCosts):
        return (costs,) * num_stages
    if isinstance(costs, Mapping):
        return costs_from_profile(costs, num_stages)
    per_stage = tuple(costs)
    if len(per_stage) != num_stages or not all(isinstance(c, OpCosts) for c in per_stage):
        raise ValueError(f"need one OpCosts per stage ({num_stages}), got {len(per_stage)} entries")
    return per_stage


def costs_from_profile(profile: Mapping[str, Any], num_stages: int) -> tuple[OpCosts, ...]:
    """Per-stage costs from a profile mapping.

    Format: top-level ``OpCosts`` fields apply to every stage (``{"t_f": 18.5, "t_b": 18.1,
    "t_w": 9.3, "t_comm": 0.6}``); an optional ``"stages"`` entry overrides fields per stage,
    either as a list with one (possibly partial) mapping per stage or as a mapping from stage
    index to such a mapping (``{"stages": {"0": {"t_f": 12.0}}}``).
    """
    base = {k: v for k, v in profile.items() if k != "stages"}
    overrides: dict[int, Mapping[str, Any]] = {}
    stages = profile.get("stages")
    if isinstance(stages, Sequence) and not isinstance(stages, str):
        if len(stages) != num_stages:
            raise ValueError(f"profile lists {len(stages)} stages, the pipeline has {num_stages}")
        overrides = dict(enumerate(stages))
    elif isinstance(stages, Mapping):
        overrides = {int(k): v for k, v in stages.items()}
        bad = [s for s in overrides if not 0 <= s < num_stages]
        if bad:
            raise ValueError(f"profile has costs for stage {bad[0]}, the pipeline has {num_stages} stages")
    elif stages is not None:
        raise ValueError("profile 'stages' must be a list or a mapping of per-stage costs")
    return tuple(OpCosts.from_dict({**base, **overrides.get(s, {})}) for s in range(num_stages))


def load_profile(path: str) -> dict[str, Any]:
    """Read a JSON cost profile (format: :func:`costs_from_profile`)."""
    with open(path) as f:
        profile = json.load(f)
    if not isinstance(profile, dict):
        raise ValueError(f"{path}: a cost profile is a JSON object")
    return profile
