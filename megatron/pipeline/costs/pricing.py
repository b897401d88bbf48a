"""What a replayed op costs: the simulator's pricing, shared with the processor-sharing model.

Why one place: the timing simulator (:mod:`megatron.pipeline.simulator`) and the shared-core
model (:mod:`megatron.pipeline.planner.shared_cores`) replay the same streams and must price
each op the same way -- its model part's costs (:func:`~.op_costs.priced_part`), the sender's
``t_send`` per message to another stage, the sender's ``t_comm`` until its messages arrive, and
a synchronous step's ``t_opt + t_sync`` on the stage itself. The shared-core model used to
restate these rules; now both read them here.
"""
from __future__ import annotations

from megatron.pipeline.costs.op_costs import CostsLike, OpCosts, priced_part, send_time, stage_costs
from megatron.pipeline.ir import Op, OpKind, PipelineLayout

__all__ = ["OpPricing"]


class OpPricing:
    """Per-op durations, send times, message delays and memory deltas of one layout's stages."""

    __slots__ = ("layout", "per_stage", "_durations", "_deltas")

    def __init__(self, layout: PipelineLayout, costs: CostsLike):
        self.layout = layout
        self.per_stage: tuple[OpCosts, ...] = stage_costs(costs, layout.num_stages)
        # tables: the simulator prices every op, and OpCosts.duration is a chain of ifs
        self._durations = [{k: c.duration(k) for k in OpKind} for c in self.per_stage]
        self._deltas = [{k: c.memory_delta(k) for k in OpKind} for c in self.per_stage]

    def part(self, op: Op) -> int:
        """The entry of ``per_stage`` that prices ``op`` (:func:`~.op_costs.priced_part`)."""
        return priced_part(self.layout, op)

    def duration(self, op: Op, part: int) -> float:
        """Compute time of ``op`` (priced as ``part``), before any send time."""
        return self._durations[part][op.kind]

    def send_time(self, op: Op, part: int) -> float:
        """What handing ``op``'s messages to the transport adds to its stage's time."""
        return send_time(self.per_stage[part], op, self.layout)

    def comm(self, part: int) -> float:
        """Delay from the end of an op priced as ``part`` to its messages' arrival elsewhere."""
        return self.per_stage[part].t_comm

    def memory_delta(self, op: Op, part: int) -> float:
        """Change of the stage's activation memory (units of ``M_B``) when ``op`` finishes."""
        return self._deltas[part][op.kind]

    def sync_step(self, stage: int) -> float:
        """Stage ``stage``'s part of a synchronous OPT (its own costs, not a model part's)."""
        return self.per_stage[stage].sync_step
