"""Which messages an op receives and sends: the single source of truth for all executors.

The validator, the emulator, the distributed runtime and the timing simulator all derive
communication from here, so they cannot disagree about it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from megatron.pipeline.ir import BACKWARD_KINDS, Hop, Op, OpKind, PipelineLayout


class MsgKind(str, enum.Enum):
    ACT = "act"  # forward activation, along the chain: layout.next_hop
    GRAD = "grad"  # gradient of that activation, back along it: layout.prev_hop
    # Optimizer post-validation, between physical stages (chunk 0); ``microbatch`` holds
    # the update index. Both carry the per-stage squared gradient norms (float64, one per
    # stage; stages the partial state has not reached yet are 0).
    PARTIAL_STATE = "partial_state"  # PSTEP: stage s -> s + 1
    GLOBAL_STATE = "global_state"  # VALIDATE: stage s + 1 -> s


@dataclass(frozen=True, slots=True)
class Message:
    kind: MsgKind
    microbatch: int
    src_stage: int
    dst_stage: int
    src_chunk: int
    dst_chunk: int

    def __str__(self) -> str:
        if self.kind in (MsgKind.PARTIAL_STATE, MsgKind.GLOBAL_STATE):
            return f"{self.kind.value}(update {self.microbatch}) s{self.src_stage}->s{self.dst_stage}"
        return (
            f"{self.kind.value}(mb{self.microbatch}) s{self.src_stage}.c{self.src_chunk}"
            f"->s{self.dst_stage}.c{self.dst_chunk}"
        )


def _message(kind: MsgKind, mb: int, src: Hop, dst: Hop) -> Message:
    return Message(kind, mb, src[0], dst[0], src[1], dst[1])


def _state_message(kind: MsgKind, update: int, src: int, dst: int) -> Message:
    return Message(kind, update, src, dst, 0, 0)


def op_recvs(op: Op, layout: PipelineLayout) -> list[Message]:
    """Messages ``op`` must receive before it can run.

    A ``DRAIN`` receives exactly what the ``F`` of its micro-batch and chunk receives, and an
    ``EVAL`` receives and sends what an ``F`` does.
    """
    s, last = op.stage, layout.num_stages - 1
    if op.kind is OpKind.PSTEP:
        return [_state_message(MsgKind.PARTIAL_STATE, op.update, s - 1, s)] if s > 0 else []
    if op.kind is OpKind.VALIDATE:
        return [_state_message(MsgKind.GLOBAL_STATE, op.update, s + 1, s)] if s < last else []
    here = (op.stage, op.chunk)
    if op.kind in (OpKind.F, OpKind.DRAIN, OpKind.EVAL) and (prev := layout.prev_hop(*here)) is not None:
        return [_message(MsgKind.ACT, op.microbatch, prev, here)]
    if op.kind in BACKWARD_KINDS and (nxt := layout.next_hop(*here)) is not None:
        return [_message(MsgKind.GRAD, op.microbatch, nxt, here)]
    return []


def op_sends(op: Op, layout: PipelineLayout) -> list[Message]:
    """Messages ``op`` produces when it finishes."""
    s, last = op.stage, layout.num_stages - 1
    if op.kind is OpKind.PSTEP:
        return [_state_message(MsgKind.PARTIAL_STATE, op.update, s, s + 1)] if s < last else []
    if op.kind is OpKind.VALIDATE:
        return [_state_message(MsgKind.GLOBAL_STATE, op.update, s, s - 1)] if s > 0 else []
    here = (op.stage, op.chunk)
    if op.kind in (OpKind.F, OpKind.EVAL) and (nxt := layout.next_hop(*here)) is not None:
        return [_message(MsgKind.ACT, op.microbatch, here, nxt)]
    if op.kind in BACKWARD_KINDS and (prev := layout.prev_hop(*here)) is not None:
        return [_message(MsgKind.GRAD, op.microbatch, here, prev)]
    return []
