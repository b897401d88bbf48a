"""Rank layout and process groups for pipeline x data (x tensor) parallelism.

Megatron's order (tensor parallel fastest, then data parallel, then pipeline) so that a
later tensor-parallel layer can hand the same ranks to ``megatron.core.parallel_state``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from megatron.pipeline.comm import Lane, directed_lanes, tied_ends, tied_lanes
from megatron.pipeline.ir import MultiPipelineLayout, PipelineLayout


@dataclass(frozen=True)
class RankLayout:
    pipeline_size: int
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return self.pipeline_size * self.data_parallel_size * self.tensor_parallel_size

    def rank(self, stage: int, dp: int = 0, tp: int = 0) -> int:
        return tp + self.tensor_parallel_size * (dp + self.data_parallel_size * stage)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, dp, tp) of a global rank."""
        tp = rank % self.tensor_parallel_size
        rest = rank // self.tensor_parallel_size
        return rest // self.data_parallel_size, rest % self.data_parallel_size, tp


def has_replicas(layout: PipelineLayout) -> bool:
    """Whether sync OPTs of this layout reduce gradients among replicated pipelines (AMDP), and so
    whether a sync step's group is :attr:`StageGroups.sync` rather than the pipeline."""
    return isinstance(layout, MultiPipelineLayout) and layout.num_pipelines > 1


@dataclass(frozen=True)
class DataParallelGroup:
    """A stage's data-parallel replicas as its gradient reduction sees them: this rank's group of
    them (same stage and TP index), how many there are, and the timeout of every wait on it.
    The transport describes it; :class:`~megatron.pipeline.runtime.gradient_sync.GradientSync`
    reduces over it, so neither needs the other."""

    group: dist.ProcessGroup | None
    size: int
    timeout: timedelta


@dataclass
class StageGroups:
    """This rank's groups. Every rank must create every group, in the same order."""

    layout: RankLayout
    rank: int
    pipeline: dist.ProcessGroup | None  # same dp/tp index, all stages
    data_parallel: dist.ProcessGroup | None  # same stage/tp index, all dp replicas
    reports: dist.ProcessGroup  # gloo side channel for statistics (never NCCL)
    # Replicated pipelines (AMDP, MultiPipelineLayout): per logical stage this rank hosts, the
    # group of its replicas; and this rank's sync group (layout.sync_group), same dp/tp index.
    replicas: dict[int, dist.ProcessGroup] = field(default_factory=dict)
    sync: dist.ProcessGroup | None = None
    sync_size: int = 0
    # Point-to-point: one two-rank group per *direction* and lane of every stage link this rank
    # uses, keyed (src stage, dst stage, lane) (comm.Lane: on a one-chain layout one lane per
    # direction, on a V both). NCCL runs a communicator's sends and receives in order on
    # one stream, so with a shared group a receive posted ahead (or a backward's receive
    # queued behind a forward's send) blocks the other direction and the pipeline deadlocks;
    # one group per direction keeps each stream one-way and in the FIFO order the schedule check
    # checks. gloo does not need it, but uses it too, so the CPU tests exercise the same path.
    p2p: dict[tuple[int, int, Lane], dist.ProcessGroup] = field(default_factory=dict)
    # Tied embeddings: the two stages holding the embedding and the output layer, same dp/tp
    # index (None: untied, or both ends on one stage, or this rank holds neither).
    embedding: dist.ProcessGroup | None = None

    @property
    def stage(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank)[1]

    @property
    def tp_rank(self) -> int:
        return self.layout.coords(self.rank)[2]

    def peer(self, stage: int) -> int:
        """The rank of ``stage`` this rank exchanges messages with: the same (dp, tp) index.
        Every TP rank of a stage runs the same op stream on the same replicated activations,
        so TP rank t of stage s talks only to TP rank t of stages s +- 1."""
        _, dp, tp = self.layout.coords(self.rank)
        return self.layout.rank(stage, dp, tp)

    def p2p_group(self, src_stage: int, dst_stage: int, lane: Lane = Lane.FORWARD) -> dist.ProcessGroup:
        """The group of ``lane``'s messages from ``src_stage`` to ``dst_stage`` (this rank's dp/tp
        index)."""
        return self.p2p[(src_stage, dst_stage, lane)]

    @classmethod
    def create(cls, layout: RankLayout, timeout: timedelta,
               stage_layout: PipelineLayout | None = None, tied_embeddings: bool = False) -> "StageGroups":
        rank = dist.get_rank()
        if dist.get_world_size() != layout.world_size:
            raise ValueError(
                f"world size {dist.get_world_size()} != pipeline {layout.pipeline_size} x data "
                f"{layout.data_parallel_size} x tensor {layout.tensor_parallel_size}"
            )
        stage, dp, tp = layout.coords(rank)
        pipeline = _create_and_pick(
            {(d, t): [layout.rank(s, d, t) for s in range(layout.pipeline_size)]
             for d in range(layout.data_parallel_size) for t in range(layout.tensor_parallel_size)},
            (dp, tp), timeout)
        data_parallel = _create_and_pick(
            {(s, t): [layout.rank(s, d, t) for d in range(layout.data_parallel_size)]
             for s in range(layout.pipeline_size) for t in range(layout.tensor_parallel_size)},
            (stage, tp), timeout)
        reports = dist.new_group(list(range(layout.world_size)), timeout=timeout, backend="gloo")
        groups = cls(layout, rank, pipeline, data_parallel, reports)
        stage_layout = stage_layout or PipelineLayout(layout.pipeline_size)
        groups._create_p2p_groups(stage_layout, timeout)
        if isinstance(stage_layout, MultiPipelineLayout):
            groups._create_replica_groups(stage_layout, timeout)
        if tied_embeddings:
            groups._create_embedding_group(stage_layout, timeout)
        return groups

    def _create_embedding_group(self, stage_layout: PipelineLayout, timeout: timedelta) -> None:
        """The stages hosting the first and the last model part (embedding, output layer), when
        they differ: Megatron's embedding group, at every dp/tp index (the synchronous step's
        sum); and the two directions of post-validation's exchange between them (TGRAD, TSUM:
        :func:`~megatron.pipeline.comm.tied_lanes`)."""
        ends = sorted(set(tied_ends(stage_layout)))
        if len(ends) == 2:
            group = self._create_over_stages(ends, timeout)
            if self.stage in ends:
                self.embedding = group
        for src, dst, lane in tied_lanes(stage_layout):
            group = self._create_over_stages([src, dst], timeout)
            if self.stage in (src, dst):
                self.p2p[(src, dst, lane)] = group

    def _create_p2p_groups(self, stage_layout: PipelineLayout, timeout: timedelta) -> None:
        """Both directions (each lane) of every hop of the layout's chains, at every dp/tp index."""
        stage = self.stage
        for src, dst, lane in directed_lanes(stage_layout):
            group = self._create_over_stages([src, dst], timeout)
            if stage in (src, dst):
                self.p2p[(src, dst, lane)] = group

    def _create_replica_groups(self, stage_layout: MultiPipelineLayout, timeout: timedelta) -> None:
        """One group per logical stage (its replicas) and per sync group, for every dp/tp index."""
        stage = self.stage
        hosted = {stage_layout.logical_stage(stage, c) for c in range(stage_layout.num_chunks)}
        for j in range(stage_layout.num_stages):
            group = self._create_over_stages(sorted(d for d, _ in stage_layout.replicas(j)), timeout)
            if j in hosted:
                self.replicas[j] = group
        for first in sorted({stage_layout.sync_group(s)[0] for s in range(self.layout.pipeline_size)}):
            members = stage_layout.sync_group(first)
            group = self._create_over_stages(list(members), timeout)
            if stage in members:
                self.sync, self.sync_size = group, len(members)

    def _create_over_stages(self, stages: list[int], timeout: timedelta) -> dist.ProcessGroup:
        """A group of ``stages`` at every dp/tp index (collective: every rank calls it); this
        rank's dp/tp index's group."""
        layout, (_, dp, tp) = self.layout, self.layout.coords(self.rank)
        picked = _create_and_pick({(d, t): [layout.rank(s, d, t) for s in stages]
                                   for d in range(layout.data_parallel_size)
                                   for t in range(layout.tensor_parallel_size)}, (dp, tp), timeout)
        assert picked is not None
        return picked


def directed_links(stage_layout: PipelineLayout) -> list[tuple[int, int]]:
    """Every (src stage, dst stage) pair a message travels between, sorted: activations along
    each chunk's next hop and gradients back (evaluation and post-validation reruns use the same hops)."""
    return sorted({(src, dst) for src, dst, _ in directed_lanes(stage_layout)})


def _create_and_pick(
    groups: dict[tuple[int, int], list[int]], mine: tuple[int, int], timeout: timedelta
) -> dist.ProcessGroup | None:
    """Create every group (a collective call, same order on all ranks); return this rank's."""
    picked = None
    for key, ranks in groups.items():
        group = dist.new_group(ranks, timeout=timeout)
        if key == mine:
            picked = group
    return picked
