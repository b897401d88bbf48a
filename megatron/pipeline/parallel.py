"""Rank layout and process groups for pipeline x data (x tensor) parallelism.

Megatron's order (tensor parallel fastest, then data parallel, then pipeline) so that a
later tensor-parallel layer can hand the same ranks to ``megatron.core.parallel_state``.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


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


@dataclass
class StageGroups:
    """This rank's groups. Every rank must create every group, in the same order."""

    layout: RankLayout
    rank: int
    pipeline: dist.ProcessGroup | None  # same dp/tp index, all stages
    data_parallel: dist.ProcessGroup | None  # same stage/tp index, all dp replicas
    reports: dist.ProcessGroup  # gloo side channel for statistics (never NCCL)

    @property
    def stage(self) -> int:
        return self.layout.coords(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        return self.layout.coords(self.rank)[1]

    @classmethod
    def create(cls, layout: RankLayout, timeout: timedelta) -> "StageGroups":
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
        return cls(layout, rank, pipeline, data_parallel, reports)


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
