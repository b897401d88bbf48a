"""The schedule IR: the ops a pipeline stage executes, in order.

Communication is not spelled out in the IR: which activations and gradients an op receives
and sends follows from its kind, stage and chunk (see :mod:`megatron.pipeline.comm`). That
keeps schedules short and makes it impossible for a schedule to name an inconsistent peer.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class OpKind(str, enum.Enum):
    """What an op computes."""

    F = "F"  # forward of one micro-batch through one model chunk
    B = "B"  # backward for the input gradient only (weight gradient deferred to W)
    W = "W"  # deferred weight-gradient computation of an earlier B
    BW = "BW"  # fused backward: input and weight gradients together
    OPT = "OPT"  # optimizer step of this stage (stage-local unless ``sync``)
    # Optimizer post-validation (Zero Bubble §4; megatron.pipeline.post_validation):
    PSTEP = "PSTEP"  # partial global state s-1 -> s -> s+1, optimistic step, grads kept
    VALIDATE = "VALIDATE"  # full global state s+1 -> s -> s-1; keep / redo / skip the step
    DISCARD = "DISCARD"  # drop a forward run on invalid weights (its stash and loss)
    DRAIN = "DRAIN"  # receive and drop a stale activation the upstream stage will re-send
    EVAL = "EVAL"  # forward-only evaluation of one micro-batch (no grad, no stash, no dropout)


#: ops that post-validation adds to a synchronous stream
POST_VALIDATION_KINDS = (OpKind.PSTEP, OpKind.VALIDATE, OpKind.DISCARD, OpKind.DRAIN)


BACKWARD_KINDS = (OpKind.B, OpKind.BW)


@dataclass(frozen=True, slots=True)
class Op:
    """One instruction of a stage's stream.

    ``microbatch`` is the *global* micro-batch index of the run (not the index inside an
    iteration), so asynchronous streams that never flush still name every micro-batch
    uniquely. For ``OPT``, ``update`` is the 0-based index of the local update it applies
    and ``sync`` marks a pipeline-wide step (all stages take it together, so gradient
    clipping and skip decisions can use the global gradient norm). ``PSTEP`` and
    ``VALIDATE`` name an update the same way; ``DISCARD`` and ``DRAIN`` a micro-batch and
    chunk like ``F``.
    """

    kind: OpKind
    stage: int
    microbatch: int = -1
    chunk: int = 0
    update: int = -1
    sync: bool = False

    def __str__(self) -> str:
        if self.kind is OpKind.OPT:
            return f"OPT#{self.update}{'(sync)' if self.sync else ''}@s{self.stage}"
        if self.kind in (OpKind.PSTEP, OpKind.VALIDATE):
            return f"{self.kind.value}#{self.update}@s{self.stage}"
        chunk = f".c{self.chunk}" if self.chunk else ""
        return f"{self.kind.value}{self.microbatch}{chunk}@s{self.stage}"

    __repr__ = __str__


def F(stage: int, mb: int, chunk: int = 0) -> Op:
    return Op(OpKind.F, stage, mb, chunk)


def B(stage: int, mb: int, chunk: int = 0) -> Op:
    return Op(OpKind.B, stage, mb, chunk)


def W(stage: int, mb: int, chunk: int = 0) -> Op:
    return Op(OpKind.W, stage, mb, chunk)


def BW(stage: int, mb: int, chunk: int = 0) -> Op:
    return Op(OpKind.BW, stage, mb, chunk)


def OPT(stage: int, update: int, sync: bool) -> Op:
    return Op(OpKind.OPT, stage, update=update, sync=sync)


def EVAL(stage: int, mb: int, chunk: int = 0) -> Op:
    return Op(OpKind.EVAL, stage, mb, chunk)


def PSTEP(stage: int, update: int) -> Op:
    return Op(OpKind.PSTEP, stage, update=update)


def VALIDATE(stage: int, update: int) -> Op:
    return Op(OpKind.VALIDATE, stage, update=update)


def DISCARD(stage: int, mb: int, chunk: int = 0) -> Op:
    return Op(OpKind.DISCARD, stage, mb, chunk)


def DRAIN(stage: int, mb: int, chunk: int = 0) -> Op:
    return Op(OpKind.DRAIN, stage, mb, chunk)


@dataclass(frozen=True, slots=True)
class PipelineLayout:
    """How model chunks map onto stages.

    Virtual stage ``v = chunk * num_stages + stage`` (Megatron's interleaved placement), so
    with one chunk per stage the virtual stage is the stage.
    """

    num_stages: int
    num_chunks: int = 1

    @property
    def num_virtual_stages(self) -> int:
        return self.num_stages * self.num_chunks

    def virtual(self, stage: int, chunk: int) -> int:
        return chunk * self.num_stages + stage

    def physical(self, virtual_stage: int) -> tuple[int, int]:
        """(stage, chunk) of a virtual stage."""
        return virtual_stage % self.num_stages, virtual_stage // self.num_stages

    def is_first(self, stage: int, chunk: int) -> bool:
        return self.virtual(stage, chunk) == 0

    def is_last(self, stage: int, chunk: int) -> bool:
        return self.virtual(stage, chunk) == self.num_virtual_stages - 1
