"""PACI and naive asynchronous 1F1B: 1F1B without flushes, stage-local updates.

PACI (Breaking the Bubble, §3, App. D Alg. 1): each stage runs one 1F1B warm-up, then
alternates forward and backward for the whole run, and applies its own optimizer step
after every ``a`` local backwards (``a`` = micro-batches per global batch per replica).

Admission rule: stage ``i`` (1-indexed) admits a new forward only with at most ``N - i``
earlier forwards unresolved. The 1F1B order realises it exactly: stage ``s`` (0-indexed)
keeps ``N - 1 - s`` forwards in flight before each new one. Between a micro-batch's
forward and its backward a stage therefore runs ``N - 1 - s`` other backwards, crossing at
most ``ceil((N - 1 - s) / a)`` of its own updates: the weight-version drift bound.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

from megatron.pipeline.ir import Op
from megatron.pipeline.schedules.base import (
    AsynchronousSchedule,
    ScheduleConfig,
    ScheduleConfigError,
    one_f_one_b,
)
from megatron.pipeline.schedules.policy import SchedulePolicy


def drift_bounds(config: ScheduleConfig) -> tuple[int, ...]:
    """:func:`drift_bound` of every stage of ``config`` (a = its micro-batches per update)."""
    return tuple(drift_bound(config.num_stages, s, config.num_microbatches) for s in range(config.num_stages))


def paci_policy(config: ScheduleConfig) -> SchedulePolicy:
    """Live weights, the run's learning rate; a gradient is at most the drift bound stale."""
    return dataclasses.replace(SchedulePolicy.plain(config.layout), gradient_delays=drift_bounds(config))


class PACI(AsynchronousSchedule):
    name = "paci"
    traits = dataclasses.replace(AsynchronousSchedule.traits, policy_for=paci_policy)

    def segment_ops(self, stage: int, microbatches: Iterable[int]) -> Iterator[Op]:
        return one_f_one_b(stage, self.config.num_stages, microbatches)


class Async1F1B(PACI):
    """PipeDream without weight stashing: PACI with ``a = 1``, one update per micro-batch."""

    name = "async-1f1b"

    @classmethod
    def check_config(cls, config: ScheduleConfig) -> None:
        super().check_config(config)
        if config.num_microbatches != 1:
            raise ScheduleConfigError(
                f"async-1f1b updates after every micro-batch, but the global batch holds "
                f"{config.num_microbatches} micro-batches per replica; use --pipeline-schedule paci "
                f"to accumulate them (a = {config.num_microbatches})"
            )


def drift_bound(num_stages: int, stage: int, accumulation: int) -> int:
    """PACI's bound on forward/backward weight-version drift of 0-indexed ``stage``:
    ``ceil((N - 1 - stage) / a)``, the paper's ``ceil((N - i) / a)`` (eq. 2) with 1-based ``i = stage + 1``."""
    return -(-(num_stages - 1 - stage) // accumulation)
