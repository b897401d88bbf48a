"""Which messages an op receives and sends: the single source of truth for all executors.

The validator, the emulator, the distributed runtime and the timing simulator all derive
communication from here, so they cannot disagree about it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from megatron.pipeline.ir import BACKWARD_KINDS, Op, OpKind, PipelineLayout


class MsgKind(str, enum.Enum):
    ACT = "act"  # forward activation, virtual stage v -> v + 1
    GRAD = "grad"  # gradient of that activation, v + 1 -> v


@dataclass(frozen=True, slots=True)
class Message:
    kind: MsgKind
    microbatch: int
    src_stage: int
    dst_stage: int
    src_chunk: int
    dst_chunk: int

    def __str__(self) -> str:
        return (
            f"{self.kind.value}(mb{self.microbatch}) s{self.src_stage}.c{self.src_chunk}"
            f"->s{self.dst_stage}.c{self.dst_chunk}"
        )


def _message(kind: MsgKind, mb: int, src_v: int, dst_v: int, layout: PipelineLayout) -> Message:
    src_stage, src_chunk = layout.physical(src_v)
    dst_stage, dst_chunk = layout.physical(dst_v)
    return Message(kind, mb, src_stage, dst_stage, src_chunk, dst_chunk)


def op_recvs(op: Op, layout: PipelineLayout) -> list[Message]:
    """Messages ``op`` must receive before it can run."""
    v = layout.virtual(op.stage, op.chunk)
    if op.kind is OpKind.F and v > 0:
        return [_message(MsgKind.ACT, op.microbatch, v - 1, v, layout)]
    if op.kind in BACKWARD_KINDS and v < layout.num_virtual_stages - 1:
        return [_message(MsgKind.GRAD, op.microbatch, v + 1, v, layout)]
    return []


def op_sends(op: Op, layout: PipelineLayout) -> list[Message]:
    """Messages ``op`` produces when it finishes."""
    v = layout.virtual(op.stage, op.chunk)
    if op.kind is OpKind.F and v < layout.num_virtual_stages - 1:
        return [_message(MsgKind.ACT, op.microbatch, v, v + 1, layout)]
    if op.kind in BACKWARD_KINDS and v > 0:
        return [_message(MsgKind.GRAD, op.microbatch, v, v - 1, layout)]
    return []
