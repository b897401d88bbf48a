"""Per-stage simulator costs and sizes of one candidate, from unit costs and a layer split.

Why per *model part*: a layout splits the model into parts (one per stage; ``v`` per stage when
interleaved; two per stage in a V; AMDP: one logical stage per pipeline on every device), and a
part's cost is its layers' plus the embedding (part 0) and the head (the last part). The
simulator takes one :class:`OpCosts` per stage for every op of that stage, except where the
layout has as many parts as devices (one chain, AMDP), where it prices each op by its part. For
chunked layouts (interleaved, V) this module therefore gives each stage the *mean* of its parts:
exact for the stage's total work per micro-batch, an approximation of the order within it (a V's
stage 0 runs the embedding chunk and the head chunk; both get the mean).

Recompute goes through :func:`megatron.pipeline.costs.activation_memory.recompute_costs` (Korthikanti
et al.'s fractions; the recomputed forward is added to B). ``m_w`` (what a split backward keeps
from B to W) is the same paper's ``32 sbh`` over a layer's ``34 sbh + 5 a s^2 b``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

from megatron.pipeline.costs.activation_memory import LayerShape, recompute_costs
from megatron.pipeline.comm_volume import replica_sync_inputs, ring_all_gather_bytes, ring_all_reduce_bytes
from megatron.pipeline.costs.cost_model import (
    ModelShape, embedding_parameters, head_parameters, layer_activation_elements, layer_parameters)
from megatron.pipeline.ir import MultiPipelineLayout, PipelineLayout
from megatron.pipeline.costs.op_costs import OpCosts, stage_mean
from megatron.pipeline.costs.unit_costs import ActivationBytes, UnitCosts

#: recompute choices: the trainer's ``--recompute-granularity`` value (None: no recompute)
RECOMPUTE = {"none": None, "selective": "selective", "full": "full"}


@dataclass(frozen=True)
class Parallelism:
    """What shards a stage besides the pipeline: tensor parallelism divides every part's
    parameters, FLOPs and activations; the distributed optimizer divides optimizer state and
    masters over the data-parallel replicas."""

    data_parallel: int = 1
    tensor_parallel: int = 1
    distributed_optimizer: bool = False


@dataclass(frozen=True)
class PartSizes:
    """One model part: its layers, parameters and the activation bytes one micro-batch keeps."""

    layers: int
    params: float
    activation_bytes: float


def part_sizes(shape: ModelShape, counts: Sequence[int], tensor_parallel: int = 1,
               measured: ActivationBytes | None = None) -> list[PartSizes]:
    """Sizes of the parts holding ``counts[j]`` layers, embedding on part 0 and head on the last;
    activations as ``measured`` by a profile (bytes at ``shape``'s micro-batch), else the analytic
    count (:func:`~megatron.pipeline.costs.cost_model.layer_activation_elements`)."""
    t, last = tensor_parallel, len(counts) - 1

    def activations(k: int, first: bool, is_last: bool) -> float:
        if measured is not None:
            return measured.part(k, first, is_last)
        return part_activation_bytes(shape, k, first, is_last)

    return [PartSizes(k, part_parameters(shape, k, j == 0, j == last) / t, activations(k, j == 0, j == last) / t)
            for j, k in enumerate(counts)]


def part_parameters(shape: ModelShape, layers: int, first: bool, last: bool) -> float:
    """Parameters of a part of ``layers`` layers, the embedding on the first, the head on the
    last (the planner's and the launcher's memory estimate's one count)."""
    return (layers * layer_parameters(shape) + (embedding_parameters(shape) if first else 0.0)
            + (head_parameters(shape) if last else 0.0))


def part_activation_bytes(shape: ModelShape, layers: int, first: bool, last: bool, kept: float = 1.0) -> float:
    """Bytes one micro-batch keeps on a part: its layers' saved activations (``kept``: the
    fraction recompute keeps), the embedding's output on the first, the fp32 logits and their
    softmax on the last."""
    tokens, act = shape.seq_length * shape.micro_batch, shape.activation_bytes
    total = layers * layer_activation_elements(shape) * act * kept
    if first:
        total += tokens * shape.hidden * act
    if last:
        total += tokens * 2 * shape.vocab * 4
    return total


def _layer_shape(shape: ModelShape) -> LayerShape:
    return LayerShape(shape.seq_length, shape.micro_batch, shape.hidden, shape.heads)


def weight_grad_fraction(shape: ModelShape) -> float:
    """``m_w = M_W / M_B`` of a layer: ``32 sbh / (34 sbh + 5 a s^2 b)`` (module docstring)."""
    ls = _layer_shape(shape)
    return ls.weight_grad_bytes() / ls.layer_bytes()


def part_weight_grad_fraction(shape: ModelShape, unit: UnitCosts, part: PartSizes, first: bool, last: bool) -> float:
    """``m_w`` of a part: measured (what a profiled B left for its W over what its F saved) when
    the unit costs carry both, else the analytic :func:`weight_grad_fraction`."""
    if unit.activations is None or unit.kept_for_w is None:
        return weight_grad_fraction(shape)
    saved = unit.activations.part(part.layers, first, last)
    return min(1.0, unit.kept_for_w.part(part.layers, first, last) / saved) if saved else 0.0


def part_costs(shape: ModelShape, unit: UnitCosts, parts: Sequence[PartSizes], par: Parallelism,
               recompute: str = "none") -> list[OpCosts]:
    """One :class:`OpCosts` per part: its F/B/W, the P2P trip, the optimizer step over its
    (sharded) parameters and the synchronous step's collective plus the data-parallel reduction."""
    last = len(parts) - 1
    out = []
    for j, part in enumerate(parts):
        p = unit.layer.scaled(part.layers)
        if j == 0:
            p = p + unit.embedding
        if j == last:
            p = p + unit.head
        shard = par.data_parallel if par.distributed_optimizer else 1
        grads = part.params * 4  # fp32 gradients are reduced
        costs = OpCosts(t_f=p.f, t_b=p.b, t_w=p.w, t_comm=unit.p2p, t_send=unit.message_cpu,
                        m_w=part_weight_grad_fraction(shape, unit, part, j == 0, j == last),
                        t_opt=part.params / shard * unit.optimizer_per_param,
                        t_sync=unit.sync + unit.reduce_ms_per_byte * ring_all_reduce_bytes(grads, par.data_parallel))
        granularity = RECOMPUTE[recompute]
        if granularity is not None and part.layers:
            costs = recompute_costs(costs, _layer_shape(shape), part.layers, granularity,
                                    "uniform" if granularity == "full" else None, 1 if granularity == "full" else None)
        out.append(costs)
    return out


def stage_parts(layout: PipelineLayout, stage: int) -> list[int]:
    """The model parts ``stage`` hosts (one per chunk)."""
    return sorted({layout.model_stage(stage, c) for c in range(layout.num_chunks)})


def simulator_costs(layout: PipelineLayout, per_part: Sequence[OpCosts], collective: float = 0.0) -> list[OpCosts]:
    """What the simulator takes: per part where the layout has one part per device (it prices an
    op by its part), else per stage the mean of its parts (module docstring); ``collective``:
    the unit costs' ``sync``, which every part's ``t_sync`` contains."""
    if layout.num_model_stages == layout.num_stages:
        return list(per_part)
    return [stage_mean([per_part[p] for p in stage_parts(layout, s)], collective) for s in range(layout.num_stages)]


def stage_activation_unit(layout: PipelineLayout, parts: Sequence[PartSizes], stage: int) -> float:
    """Bytes of the simulator's memory unit ``M_B`` on ``stage``: one op's activations, the mean
    over the stage's parts (exact with one part per stage)."""
    hosted = stage_parts(layout, stage)
    return sum(parts[p].activation_bytes for p in hosted) / len(hosted)


def stage_params(layout: PipelineLayout, parts: Sequence[PartSizes], stage: int) -> float:
    return sum(parts[p].params for p in stage_parts(layout, stage))


def replica_step_costs(layout: MultiPipelineLayout, parts: Sequence[PartSizes], costs: Sequence[OpCosts],
                       unit: UnitCosts) -> list[OpCosts]:
    """AMDP's window update priced per device: ``costs`` with each device's ``t_opt`` and
    ``t_sync`` covering every replica it hosts (sharded optimizer state, AMDP's default).

    Why: a device's synchronous OPT all-gathers each hosted replica's gradients with that
    logical stage's other replicas, steps its range of each, and all-gathers the updated
    ranges (:mod:`megatron.pipeline.runtime.replicas`; fp32, as
    :func:`~megatron.pipeline.comm_volume.replica_sync_inputs` counts them); at D = 4 on a CPU
    host that traffic is most of the gap between the chain schedules and AMDP. The simulator prices a device's OPT
    by entry ``d`` (its pipeline-0 logical stage, :func:`~megatron.pipeline.costs.op_costs.priced_part`),
    so that entry carries the device's sums; its F/B/W prices stay the logical stage's."""
    replicas = layout.num_pipelines
    out = list(costs)
    for device in range(layout.num_stages):
        hosted = [int(parts[p].params) for p in stage_parts(layout, device)]
        grads, params = replica_sync_inputs(hosted, replicas)
        sent = ring_all_gather_bytes(grads, replicas) + ring_all_gather_bytes(params, replicas)
        out[device] = dataclasses.replace(costs[device], t_opt=sum(hosted) / replicas * unit.optimizer_per_param,
                                          t_sync=unit.sync + unit.reduce_ms_per_byte * sent)
    return out


def hosts_replicas(layout: PipelineLayout) -> TypeGuard[MultiPipelineLayout]:
    """Whether the layout places replicated whole-model pipelines (AMDP) rather than one chain."""
    return isinstance(layout, MultiPipelineLayout)
