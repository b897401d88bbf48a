"""Another stage layout ``--pipeline-schedule auto`` may rebuild a running job in: what it is,
and what its ops cost, priced from the chain the run profiled.

Why: a run profiles on the chain it was built as (one model part per stage), but the fastest
synchronous schedule may need another placement: a V (two half-size parts per stage, the
first and the last model part on stage 0) or interleaving (``v`` parts per stage). The
trainer can rebuild its stages in such a layout at a drained iteration boundary, through a
checkpoint that reshards by parameter name (``megatron.trainer.loop.auto.rebuild``); this module
lets ``auto`` rank those layouts with the profiled costs, as it ranks the chain's schedules.

Pricing another layout from a chain's profile: every op's time is affine in the layers of
the part it runs, ``k * layer + [first part] * embedding + [last part] * head``. A chain
stage ``s`` with ``k_s`` layers gives one equation per op kind; the embedding's share is
taken as zero (a row gather forward, a scatter-add backward: ``O(s h)`` against a layer's
``O(s h^2)``), so the stages before the last give the per-layer cost and the last stage's
remainder is the head's (the output layer and the loss):
:func:`~megatron.pipeline.costs.unit_costs.layer_and_head`, as the planner's own profile does. ``t_comm`` (the link) and each part's ``m_w`` carry over: the last part keeps the last
stage's, the others the layer-weighted mean of the other stages'.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron.pipeline.costs.op_costs import OpCosts
from megatron.pipeline.costs import stages as st
from megatron.pipeline.planner.candidates import Candidate
from megatron.pipeline.planner.evaluate import activation_peaks
from megatron.pipeline.costs.unit_costs import layer_and_head
from megatron.pipeline.schedules import ScheduleOptions, schedule_class
from megatron.pipeline.simulator import SimulationResult

@dataclass(frozen=True)
class Relayout:
    """A layout the trainer can rebuild the run in, for schedule ``schedule``: ``num_chunks``
    model parts per stage, ``part_layers`` layers per model part (model order), and the
    schedule's ``options`` from the flags it would run with (how it orders its ops)."""

    schedule: str
    num_chunks: int
    part_layers: tuple[int, ...]
    options: ScheduleOptions = field(default_factory=ScheduleOptions, compare=False, hash=False)
    #: activation bytes one micro-batch keeps on each part (model order; the analytic model of
    #: :func:`~megatron.pipeline.costs.stages.part_sizes`); () when unknown
    part_bytes: tuple[float, ...] = ()

    @property
    def label(self) -> str:
        """The schedule with its parts per stage (``interleaved-1f1b x4``): one schedule may
        come in several chunk counts."""
        return f"{self.schedule} x{self.num_chunks}"

    def candidate(self, num_stages: int, num_microbatches: int) -> Candidate:
        split = "even" if len(set(self.part_layers)) <= 1 else "balanced"  # the trainer's default split of the rebuild
        return Candidate(self.schedule, num_stages, 1, num_microbatches, self.num_chunks, "none", split,
                         self.part_layers)


def part_costs(costs: Sequence[OpCosts], stage_layers: Sequence[int], part_layers: Sequence[int]) -> list[OpCosts]:
    """Each model part's costs (``part_layers``, model order) priced from a chain's per-stage
    ``costs`` with ``stage_layers`` (module docstring)."""
    layer, head = layer_and_head([dataclasses.asdict(c) for c in costs], stage_layers)
    body = list(zip(costs[:-1], stage_layers[:-1]))
    body_m_w = sum(c.m_w * k for c, k in body) / sum(k for _, k in body)
    link = max(c.t_comm for c in costs)
    out = []
    for j, k in enumerate(part_layers):
        last = j == len(part_layers) - 1
        p = layer.scaled(k) + head if last else layer.scaled(k)
        out.append(OpCosts(t_f=p.f, t_b=p.b, t_w=p.w, t_comm=link, m_w=costs[-1].m_w if last else body_m_w))
    return out


def relayout_stage_costs(relayout: Relayout, num_stages: int, num_microbatches: int, costs: Sequence[OpCosts],
                         stage_layers: Sequence[int]) -> tuple[object, list[OpCosts], list[OpCosts]]:
    """(its layout, each part's costs, what the simulator takes: per stage, the mean of its
    parts' costs, :func:`~megatron.pipeline.costs.stages.simulator_costs`) of ``relayout``."""
    cand = relayout.candidate(num_stages, num_microbatches)
    layout = schedule_class(cand.schedule).traits.layout_of(cand.config(1))
    per_part = part_costs(costs, stage_layers, relayout.part_layers)
    return layout, per_part, st.simulator_costs(layout, per_part)


def peaks_in_chain_units(relayout: Relayout, layout: object, result: SimulationResult, per_part: Sequence[OpCosts],
                         stage_bytes: Sequence[float]) -> tuple[float, ...]:
    """Each stage's simulated activation peak in the units a memory limit is given in: its
    chain stage's ``M_B`` (``stage_bytes``, the chain's per-stage bytes of one micro-batch),
    walking the relayout's ops with each op's own part's bytes
    (:func:`~megatron.pipeline.planner.evaluate.activation_peaks`)."""
    parts = [st.PartSizes(k, 0.0, b) for k, b in zip(relayout.part_layers, relayout.part_bytes)]
    peaks = activation_peaks(result, layout, parts, list(per_part))
    return tuple(p / b for p, b in zip(peaks, stage_bytes))
