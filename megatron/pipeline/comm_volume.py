"""How many bytes each pipeline stage hands to communication per training step (torch-free).

Why: the schedules differ in what they send (interleaving multiplies the activation hops,
post-validation adds the norm messages, AMDP replaces the data-parallel all-reduce by replica
gathers), and a benchmark that counts the runtime's real traffic needs an independent figure to
compare with. This module derives it from the schedule's op streams and
:mod:`megatron.pipeline.comm` (the same source of truth the executors use), so it counts
exactly the messages the schedule implies, plus the step's collectives the runtime issues:

* **P2P**: every message an op sends (:func:`~megatron.pipeline.comm.op_sends`), an activation
  or its gradient of ``activation_elements`` elements, or a post-validation norm message
  (float64, one per stage);
* **data-parallel reduction**: with ``data_parallel_size > 1`` each optimizer step (``OPT``, or
  ``PSTEP`` under post-validation) all-reduces the stage's trained gradients once;
* **sync norms**: a synchronous ``OPT`` all-gathers one float64 per stage over the sync group;
* **AMDP replicas** (:class:`~megatron.pipeline.ir.MultiPipelineLayout`): a synchronous ``OPT``
  all-gathers each hosted replica's flat gradients over that logical stage's replicas, and,
  with sharded optimizer state, each replica's parameter range (padded to the longest) after
  the step.

Volumes are *payload* bytes: what a rank hands to ``isend`` or to a collective as its input.
What a collective puts on the wire depends on its algorithm; :func:`ring_all_reduce_bytes` and
:func:`ring_all_gather_bytes` give the ring's per-rank send volume (Patarasuk and Yuan 2009;
the textbook ``2(n-1)/n`` of an all-reduce).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron.pipeline.comm import MsgKind, op_sends
from megatron.pipeline.ir import MultiPipelineLayout, Op, OpKind, PipelineLayout
from megatron.pipeline.schedules.zero_bubble.post_validation import ValidationOutcomes

if TYPE_CHECKING:
    from megatron.pipeline.schedules.base import Schedule

FLOAT64_BYTES = 8
STATE_KINDS = (MsgKind.PARTIAL_STATE, MsgKind.GLOBAL_STATE)


@dataclass(frozen=True)
class CommShapes:
    """The sizes communication volume follows from.

    ``chunk_params``: trained parameter elements of each (stage, chunk) model part; ``grad_bytes``
    and ``param_bytes``: bytes per gradient / parameter element as reduced (fp32 by default).
    ``sharded_replicas``: AMDP's optimizer state is sharded over the replicas (its default with
    AdamW), so the step ends with a parameter all-gather.
    """

    activation_elements: int
    activation_bytes: int
    chunk_params: Mapping[tuple[int, int], int]
    data_parallel_size: int = 1
    grad_bytes: int = 4
    param_bytes: int = 4
    sharded_replicas: bool = True

    @property
    def message_bytes(self) -> int:
        return self.activation_elements * self.activation_bytes

    def stage_params(self, stage: int) -> int:
        return sum(n for (s, _), n in self.chunk_params.items() if s == stage)


@dataclass
class StageVolume:
    """Payload bytes one rank of ``stage`` hands to communication, summed over a stream."""

    p2p: Counter[str] = field(default_factory=Counter)  # MsgKind value -> bytes sent
    p2p_messages: int = 0
    data_parallel: int = 0  # all-reduce input bytes
    sync_norms: int = 0  # all-gather input bytes (float64 norms)
    replica_grads: int = 0  # AMDP: all-gather input bytes (flat gradients)
    replica_params: int = 0  # AMDP, sharded state: all-gather input bytes (parameter ranges)
    updates: int = 0  # optimizer steps taken

    def scaled(self, factor: float) -> dict[str, float]:
        """Every field times ``factor`` (per step: 1 / iterations), flat, keyed by name."""
        out = {f"p2p_{kind}": bytes_ * factor for kind, bytes_ in sorted(self.p2p.items())}
        out.update(p2p_messages=self.p2p_messages * factor, data_parallel=self.data_parallel * factor,
                   sync_norms=self.sync_norms * factor, replica_grads=self.replica_grads * factor,
                   replica_params=self.replica_params * factor, updates=self.updates * factor)
        return out


def ring_all_reduce_bytes(payload: float, ranks: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``payload`` bytes: ``2(n-1)/n`` of it."""
    return 2.0 * (ranks - 1) / ranks * payload if ranks > 1 else 0.0


def ring_all_gather_bytes(payload: float, ranks: int) -> float:
    """Bytes one rank sends in a ring all-gather of a ``payload``-byte input: ``(n-1)`` inputs."""
    return float((ranks - 1) * payload)


def replica_sync_inputs(chunk_params: Iterable[int], replicas: int, grad_bytes: int = 4, param_bytes: int = 4,
                        sharded: bool = True) -> tuple[int, int]:
    """(gradient, parameter) all-gather input bytes of a device's AMDP window update, hosting
    replicas of ``chunk_params`` elements each: every replica's flat gradients, and with
    sharded state every replica's parameter range (``ceil(n / replicas)``, padded to the longest)."""
    chunks = list(chunk_params)
    grads = sum(chunks) * grad_bytes
    params = sum(-(-n // replicas) for n in chunks) * param_bytes if sharded else 0
    return grads, params


def _replica_count(layout: PipelineLayout) -> int:
    return layout.num_pipelines if isinstance(layout, MultiPipelineLayout) else 1


def stream_volume(ops: Iterable[Op], layout: PipelineLayout, shapes: CommShapes) -> StageVolume:
    """Payload bytes of one stage's op stream (one rank of that stage)."""
    volume = StageVolume()
    replicas = _replica_count(layout)
    for op in ops:
        for msg in op_sends(op, layout):
            size = layout.num_stages * FLOAT64_BYTES if msg.kind in STATE_KINDS else shapes.message_bytes
            volume.p2p[msg.kind.value] += size
            volume.p2p_messages += 1
        if op.kind not in (OpKind.OPT, OpKind.PSTEP):
            continue
        volume.updates += 1
        if shapes.data_parallel_size > 1:
            volume.data_parallel += shapes.stage_params(op.stage) * shapes.grad_bytes
        if op.kind is not OpKind.OPT or not op.sync:
            continue
        if replicas > 1:
            grads, params = replica_sync_inputs((n for (s, _), n in shapes.chunk_params.items() if s == op.stage),
                                                replicas, shapes.grad_bytes, shapes.param_bytes, shapes.sharded_replicas)
            volume.replica_grads += grads
            volume.replica_params += params
        if len(layout.sync_group(op.stage)) > 1:
            volume.sync_norms += FLOAT64_BYTES
    return volume


def step_comm_volume(schedule: "Schedule", shapes: CommShapes, reruns: bool = False) -> list[dict[str, float]]:
    """Per stage, the payload bytes one of its ranks sends per training step (iteration),
    averaged over the schedule's ``num_iterations`` (asynchronous schedules fill and drain
    once per stream, which the average includes). Under post-validation, ``reruns`` is what
    every VALIDATE decides (False: no rollback, the common case; True: every update re-runs
    its pre-validation forwards, the most traffic)."""
    iterations = schedule.config.num_iterations
    if iterations is None:
        raise ValueError("step_comm_volume needs a finite number of iterations")
    if schedule.policy.post_validated:  # walk a copy: outcomes are per stream
        schedule = schedule.segment(schedule.config.first_iteration, iterations)
        validation = schedule.policy.post_validation
        assert validation is not None
        validation.outcomes = ValidationOutcomes(assume=reruns)
    layout = schedule.layout
    return [stream_volume(schedule.stage_ops(s), layout, shapes).scaled(1.0 / iterations)
            for s in range(layout.num_stages)]


def analytic_p2p_bytes(layout: PipelineLayout, stage: int, num_microbatches: int,
                       message_bytes: int) -> tuple[float, float]:
    """The closed form for one rank of ``stage`` and one step, (activation, gradient) bytes:
    each micro-batch sends its activation over every outgoing hop of the chunks it passes on
    this stage and its gradient back over every incoming one, ``m * s*b*h * dtype`` per
    direction per hop (AMDP: a chunk is one pipeline, which gets ``m / P`` of the micro-batches)."""
    share = num_microbatches / _replica_count(layout) * message_bytes
    chunks = range(layout.num_chunks)
    return (share * sum(layout.next_hop(stage, c) is not None for c in chunks),
            share * sum(layout.prev_hop(stage, c) is not None for c in chunks))
