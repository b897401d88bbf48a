"""Which messages an op receives and sends: the single source of truth for all executors.

The schedule check, the emulator, the distributed runtime and the timing simulator all derive
communication from here, so they cannot disagree about it.
"""
from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass

from megatron.pipeline.ir import BACKWARD_KINDS, TIED_EXCHANGE_KINDS, Hop, Op, OpKind, PipelineLayout


class MsgKind(str, enum.Enum):
    ACT = "act"  # forward activation, along the chain: layout.next_hop
    GRAD = "grad"  # gradient of that activation, back along it: layout.prev_hop
    # Optimizer post-validation, between physical stages (chunk 0); ``microbatch`` holds
    # the update index. Both carry the per-stage squared gradient norms (float64, one per
    # stage; stages the partial state has not reached yet are 0).
    PARTIAL_STATE = "partial_state"  # PSTEP: stage s -> s + 1
    GLOBAL_STATE = "global_state"  # VALIDATE: stage s + 1 -> s
    # Tied embeddings under post-validation (TGRAD, TSUM), between the stage of the output
    # layer's copy and the embedding's (:func:`tied_ends`); ``microbatch`` holds the update.
    TIED_GRAD = "tied_grad"  # TGRAD: the copy's gradient, output layer's stage -> embedding's
    TIED_SUM = "tied_sum"  # TSUM: the two ends' sum, embedding's stage -> output layer's


class Lane(str, enum.Enum):
    """The FIFO channel a message travels in between two stages.

    Messages of one lane from one stage to another arrive in the order they were sent (NCCL
    and gloo match untagged point-to-point calls in order); the two lanes are independent (the
    runtime gives each its own two-rank group, one direction each). Activations (and the
    partial state that follows them down) and gradients (and the global state that follows
    them up) never wait for each other: on a one-chain layout each lane is one direction of a
    link, and on a V (both chunks crossing every link, in opposite directions) a link carries
    chunk 0's activations and chunk 1's gradients the same way, whose relative order the two
    stages need not share.
    """

    FORWARD = "forward"  # ACT, PARTIAL_STATE
    BACKWARD = "backward"  # GRAD, GLOBAL_STATE
    TIED = "tied"  # TIED_GRAD, TIED_SUM: the tied embedding's two ends, each direction alone


@dataclass(frozen=True, slots=True)
class Message:
    kind: MsgKind
    microbatch: int
    src_stage: int
    dst_stage: int
    src_chunk: int
    dst_chunk: int

    @property
    def lane(self) -> Lane:
        if self.kind in (MsgKind.TIED_GRAD, MsgKind.TIED_SUM):
            return Lane.TIED
        return Lane.FORWARD if self.kind in (MsgKind.ACT, MsgKind.PARTIAL_STATE) else Lane.BACKWARD

    @property
    def local(self) -> bool:
        """A stage sending to itself (a V's turn): handed over in memory, no transfer."""
        return self.src_stage == self.dst_stage

    def __str__(self) -> str:
        if self.kind not in (MsgKind.ACT, MsgKind.GRAD):
            return f"{self.kind.value}(update {self.microbatch}) s{self.src_stage}->s{self.dst_stage}"
        return (
            f"{self.kind.value}(mb{self.microbatch}) s{self.src_stage}.c{self.src_chunk}"
            f"->s{self.dst_stage}.c{self.dst_chunk}"
        )


def fifo_channel(msg: Message) -> Hashable:
    """The queue ``msg`` is delivered in order within: its (src, dst, lane); a local message is
    its own queue (the runtime hands it over by name, P2PChannel)."""
    return msg if msg.local else (msg.src_stage, msg.dst_stage, msg.lane)


def directed_lanes(layout: PipelineLayout) -> list[tuple[int, int, Lane]]:
    """Every (src stage, dst stage, lane) a message travels, sorted: activations along each
    chunk's next hop, gradients back (evaluation, post-validation reruns and states use the
    same lanes of a chain's links); local hops need none."""
    lanes = set()
    for stage in range(layout.num_stages):
        for chunk in range(layout.num_chunks):
            hop = layout.next_hop(stage, chunk)
            if hop is not None and hop[0] != stage:
                lanes.update({(stage, hop[0], Lane.FORWARD), (hop[0], stage, Lane.BACKWARD)})
    return sorted(lanes)


def tied_ends(layout: PipelineLayout) -> tuple[int, int]:
    """(stage of the embedding, stage of the output layer): the hosts of the first and the last
    model part, where a tied embedding's two ends live (one stage on a V or at PP = 1)."""
    def host(part: int) -> int:
        return next(s for s in range(layout.num_stages) for c in range(layout.num_chunks)
                    if layout.model_stage(s, c) == part)

    return host(0), host(layout.num_model_stages - 1)


def tied_lanes(layout: PipelineLayout) -> list[tuple[int, int, Lane]]:
    """The (src, dst, lane) the tied embedding's exchange travels (TGRAD, TSUM): both directions
    between its two ends' stages; none when one stage holds both."""
    embedding, output = tied_ends(layout)
    return [] if embedding == output else [(output, embedding, Lane.TIED), (embedding, output, Lane.TIED)]


def _tied_messages(op: Op, layout: PipelineLayout, sends: bool) -> list[Message]:
    """What a TGRAD or TSUM of ``op.stage`` sends (``sends``) or receives: the output layer's
    stage sends the copy's gradient at TGRAD and receives the sum at TSUM; the embedding's stage
    receives that gradient and sends the sum at TSUM."""
    embedding, output = tied_ends(layout)
    if embedding == output or op.stage not in (embedding, output):
        raise ValueError(f"{op}: only the two stages of a tied embedding's ends exchange (stages "
                         f"{embedding} and {output})")
    grad = Message(MsgKind.TIED_GRAD, op.update, output, embedding, 0, 0)
    total = Message(MsgKind.TIED_SUM, op.update, embedding, output, 0, 0)
    if op.kind is OpKind.TGRAD:
        if op.stage != output:
            raise ValueError(f"{op}: only the output layer's stage ({output}) sends its copy's gradient")
        return [grad] if sends else []
    if op.stage == embedding:
        return [total] if sends else [grad]
    return [] if sends else [total]


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
    if op.kind in TIED_EXCHANGE_KINDS:
        return _tied_messages(op, layout, sends=False)
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
    if op.kind in TIED_EXCHANGE_KINDS:
        return _tied_messages(op, layout, sends=True)
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
