"""The schedule IR: the ops a pipeline stage executes, in order.

Communication is not spelled out in the IR: which activations and gradients an op receives
and sends follows from its kind, stage and chunk (see :mod:`megatron.pipeline.comm`). That
keeps schedules short and makes it impossible for a schedule to name an inconsistent peer.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class OpKind(str, enum.Enum):
    """What an op computes."""

    F = "F"  # forward of one micro-batch through one model chunk
    B = "B"  # backward for the input gradient only (weight gradient deferred to W)
    W = "W"  # deferred weight-gradient computation of an earlier B
    BW = "BW"  # fused backward: input and weight gradients together
    OPT = "OPT"  # optimizer step of this stage (stage-local unless ``sync``)
    # Optimizer post-validation (Zero Bubble §4; megatron.pipeline.schedules.zero_bubble.post_validation):
    PSTEP = "PSTEP"  # partial global state s-1 -> s -> s+1, optimistic step, grads kept
    VALIDATE = "VALIDATE"  # full global state s+1 -> s -> s-1; keep / redo / skip the step
    DISCARD = "DISCARD"  # drop a forward run on invalid weights (its stash and loss)
    DRAIN = "DRAIN"  # receive and drop a stale activation the upstream stage will re-send
    # Tied embeddings under post-validation (megatron.pipeline.schedules.zero_bubble.tied_exchange):
    TGRAD = "TGRAD"  # the output layer's stage sends its tied copy's gradient to the embedding's
    TSUM = "TSUM"  # embedding's stage: add that gradient, send the sum back; output's: take the sum
    EVAL = "EVAL"  # forward-only evaluation of one micro-batch (no grad, no stash, no dropout)


#: ops that sum the tied embedding's two ends before a post-validated step
TIED_EXCHANGE_KINDS = (OpKind.TGRAD, OpKind.TSUM)

#: ops that post-validation adds to a synchronous stream
POST_VALIDATION_KINDS = (OpKind.PSTEP, OpKind.VALIDATE, OpKind.DISCARD, OpKind.DRAIN, *TIED_EXCHANGE_KINDS)

#: ops naming an update (``Op.update``) rather than a micro-batch, besides OPT
UPDATE_KINDS = (OpKind.PSTEP, OpKind.VALIDATE, *TIED_EXCHANGE_KINDS)


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
        if self.kind in UPDATE_KINDS:
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


def TGRAD(stage: int, update: int) -> Op:
    return Op(OpKind.TGRAD, stage, update=update)


def TSUM(stage: int, update: int) -> Op:
    return Op(OpKind.TSUM, stage, update=update)


def DISCARD(stage: int, mb: int, chunk: int = 0) -> Op:
    return Op(OpKind.DISCARD, stage, mb, chunk)


def DRAIN(stage: int, mb: int, chunk: int = 0) -> Op:
    return Op(OpKind.DRAIN, stage, mb, chunk)


Hop = tuple[int, int]  # (stage, chunk): where a model part lives


@dataclass(frozen=True, slots=True)
class PipelineLayout:
    """How model chunks map onto stages, and which chain of (stage, chunk) hops a micro-batch
    follows.

    Virtual stage ``v = chunk * num_stages + stage`` (Megatron's interleaved placement), so
    with one chunk per stage the virtual stage is the stage. Every micro-batch visits all
    virtual stages in order: one chain.

    Communication, the model split and the optimizer collectives are all derived from the
    methods below (:meth:`next_hop`, :meth:`prev_hop`, :meth:`model_stage`,
    :meth:`sync_group`), so a layout with several chains (:class:`MultiPipelineLayout`) only
    has to override them.
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

    # -- the chain API: everything else derives from these ----------------------------
    @property
    def num_model_stages(self) -> int:
        """Into how many consecutive parts the model is split (layers per part)."""
        return self.num_virtual_stages

    def model_stage(self, stage: int, chunk: int) -> int:
        """Which part of the model chunk ``chunk`` of ``stage`` holds."""
        return self.virtual(stage, chunk)

    def next_hop(self, stage: int, chunk: int) -> Hop | None:
        """Where this chunk's activations go (None on the last part of the model)."""
        v = self.virtual(stage, chunk)
        return self.physical(v + 1) if v + 1 < self.num_virtual_stages else None

    def prev_hop(self, stage: int, chunk: int) -> Hop | None:
        """Where this chunk's input comes from (None on the first part of the model)."""
        v = self.virtual(stage, chunk)
        return self.physical(v - 1) if v > 0 else None

    def microbatch_chunks(self, microbatch: int) -> range:
        """The chunks a micro-batch passes through on every stage."""
        return range(self.num_chunks)

    def sync_group(self, stage: int) -> tuple[int, ...]:
        """The stages a ``sync`` OPT of ``stage`` is a collective with: here all of them."""
        return tuple(range(self.num_stages))

    def part_layer_split(self, stage_split: Sequence[int] | None) -> list[int] | None:
        """Layers per model part (:meth:`model_stage` order) from a per-stage split
        (``--pipeline-layer-split``); None: the even split. One part per stage: the split as it
        is; several chunks per stage: a split with one count per model part (the balanced split
        of a chunked layout, :mod:`megatron.pipeline.costs.chunk_partition`), else the even one."""
        if stage_split is None:
            return None
        if len(stage_split) == self.num_model_stages:
            return [int(c) for c in stage_split]
        if self.num_model_stages != self.num_stages:
            return None
        raise ValueError(f"a layer split of {len(stage_split)} counts for {self.num_stages} stages")

    def is_first(self, stage: int, chunk: int) -> bool:
        return self.model_stage(stage, chunk) == 0

    def is_last(self, stage: int, chunk: int) -> bool:
        return self.model_stage(stage, chunk) == self.num_model_stages - 1


@dataclass(frozen=True, slots=True)
class MultiPipelineLayout(PipelineLayout):
    """``num_chunks`` = P whole-model pipelines over the same ``num_stages`` = D devices (AMDP).

    Pipeline ``p`` takes the chunk slot ``p`` on every device (in the chain API's
    ``(stage, chunk)`` arguments and hops, and in an op's ``chunk`` field, ``chunk`` is the
    pipeline index) and is a chain of its own: its logical stage
    ``j`` (model part ``j`` of ``D``) lives on device :meth:`device`\ ``(p, j)``, and its
    messages flow from the device of ``j`` to that of ``j + 1``. Pipelines are replicas of
    the whole model: logical stage ``j`` of every pipeline has the same layers and weights.
    Micro-batch ``m`` runs on pipeline ``m mod P`` (AMDP's assignment).

    Placement, D = 0 (mod 4) (Chimera-style, the AMDP code's mapping for D = 4 and 8): even
    ``p`` runs down, ``j -> (j + 2p) mod D``; odd ``p`` runs up, ``j -> (D - 1 - j + 2(p - 1))
    mod D``. Each is a bijection, and a device hosts P distinct logical stages (even pipelines
    give it the stages ``-2p`` mod D, even numbers spaced by 4, odd ones odd numbers, all
    distinct because fewer than D/4 + 1 of each).

    Placement, D = 2 (mod 4): every pipeline runs down, ``j -> (j + 2p) mod D``, so device
    ``s`` hosts the stages of its parity. With P = D/2 odd, no placement that has pipelines
    in both directions lets the devices of a stage form a group smaller than all D devices:
    a group closed under replicas holds exactly P devices and P stages (each of its devices
    hosts P distinct stages of the group, each stage has P replicas in it); relabelling
    devices so pipeline 0 is the identity, the group's stage set is invariant under a
    reversed pipeline ``j -> c - j``; ``c`` must be odd (an even ``c`` has a fixed point,
    a device that would host one stage twice), and a fixed-point-free involution only
    leaves sets of even size invariant, but P is odd. One direction keeps the window step
    within the P devices that hold the same stages (and simulates faster at D = 6: 1.13x
    1F1B-flush at T = 4D against 0.97x with alternating directions, t_B = 2 t_F).

    The replicas of logical stage ``j`` live on the devices ``{device(p, j)}``; a ``sync``
    OPT is a collective over the connected component of that relation (:meth:`sync_group`):
    for D = 4 and 8 the AMDP code's mirror groups ({0,3},{1,2}; {0,3,4,7},{1,2,5,6}), for
    D = 6 the parities ({0,2,4},{1,3,5}); for every even D the devices of a group host the
    same logical stages.
    """

    @property
    def num_pipelines(self) -> int:
        return self.num_chunks

    def runs_down(self, pipeline: int) -> bool:
        """Whether ``pipeline``'s stage ``j + 1`` is on the device after stage ``j``'s."""
        return pipeline % 2 == 0 or self.num_stages % 4 == 2

    def device(self, pipeline: int, logical_stage: int) -> int:
        d = self.num_stages
        if self.runs_down(pipeline):
            return (logical_stage + 2 * pipeline) % d
        return (d - 1 - logical_stage + 2 * (pipeline - 1)) % d

    def logical_stage(self, stage: int, pipeline: int) -> int:
        """Which logical stage of ``pipeline`` device ``stage`` hosts (inverse of :meth:`device`)."""
        d = self.num_stages
        if self.runs_down(pipeline):
            return (stage - 2 * pipeline) % d
        return (d - 1 - stage + 2 * (pipeline - 1)) % d

    @property
    def num_model_stages(self) -> int:
        return self.num_stages

    def model_stage(self, stage: int, chunk: int) -> int:
        return self.logical_stage(stage, chunk)

    def next_hop(self, stage: int, chunk: int) -> Hop | None:
        j = self.logical_stage(stage, chunk)
        return (self.device(chunk, j + 1), chunk) if j + 1 < self.num_stages else None

    def prev_hop(self, stage: int, chunk: int) -> Hop | None:
        j = self.logical_stage(stage, chunk)
        return (self.device(chunk, j - 1), chunk) if j > 0 else None

    def microbatch_chunks(self, microbatch: int) -> range:
        p = microbatch % self.num_pipelines
        return range(p, p + 1)

    def replicas(self, logical_stage: int) -> list[Hop]:
        """(device, pipeline) of logical stage ``logical_stage`` in every pipeline, pipeline order."""
        return [(self.device(p, logical_stage), p) for p in range(self.num_pipelines)]

    def sync_group(self, stage: int) -> tuple[int, ...]:
        group, frontier = {stage}, [stage]
        while frontier:
            s = frontier.pop()
            for pipe in range(self.num_pipelines):
                for device, _ in self.replicas(self.logical_stage(s, pipe)):
                    if device not in group:
                        group.add(device)
                        frontier.append(device)
        return tuple(sorted(group))


@dataclass(frozen=True, slots=True)
class VShapeLayout(PipelineLayout):
    """Two chunks per device in a V (Qi et al., "Pipeline Parallelism with Controllable Memory"):
    device ``i`` holds virtual stages ``i`` (chunk 0) and ``2p - 1 - i`` (chunk 1).

    A micro-batch runs down the devices through chunk 0 and back up through chunk 1, so the hop
    from virtual stage ``p - 1`` to ``p`` stays on device ``p - 1`` (a message from a stage to
    itself, handed over without a transfer, :mod:`megatron.pipeline.comm`) and device 0 holds
    both the first and the last virtual stage (embedding and head on one rank: it carries more
    memory, the ZB fork's issue #36). Only :meth:`virtual` and :meth:`physical` differ from
    the interleaved placement; chains, hops, model split and communication derive from them.

    ``--pipeline-layer-split`` gives layers per device, each device's count halved between its
    two chunks (:meth:`part_layer_split`), so it must be even; or one count per chunk in model
    order (``2p`` counts: the balanced split, :mod:`megatron.pipeline.costs.chunk_partition`).
    """

    num_chunks: int = 2

    def __post_init__(self) -> None:
        if self.num_chunks != 2:
            raise ValueError(f"a V-shape layout has 2 chunks per stage, got {self.num_chunks}")

    def virtual(self, stage: int, chunk: int) -> int:
        return stage if chunk == 0 else 2 * self.num_stages - 1 - stage

    def physical(self, virtual_stage: int) -> tuple[int, int]:
        p = self.num_stages
        return (virtual_stage, 0) if virtual_stage < p else (2 * p - 1 - virtual_stage, 1)

    def part_layer_split(self, stage_split: Sequence[int] | None) -> list[int] | None:
        if stage_split is None:
            return None
        if len(stage_split) == self.num_model_stages:  # one count per V chunk (model order)
            return [int(c) for c in stage_split]
        odd = [(s, c) for s, c in enumerate(stage_split) if c % 2]
        if odd:
            raise ValueError(f"--pipeline-layer-split gives stage {odd[0][0]} {odd[0][1]} layers, which do not "
                             f"halve into its two V chunks (give every stage an even count)")
        return [int(stage_split[self.physical(v)[0]]) // 2 for v in range(self.num_virtual_stages)]
