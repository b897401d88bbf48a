"""The emulator's transport: every stage of one data-parallel replica in this process.

A collective over stages is a loop over the local workers in stage order (the order the
distributed transport's gathers return), a sum over processes is the value itself, a barrier
is nothing, and a message is a clone (a receiver holds its own buffer, as in the runtime).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from megatron.pipeline.ir import MultiPipelineLayout, Op, PipelineLayout
from megatron.pipeline.runtime.transport import ReportSink, Transport

if TYPE_CHECKING:
    from megatron.pipeline.schedules.base import Schedule

CLONE_ROUNDS = 5


class InProcessTransport(Transport):
    name = "emulator"
    in_process = True

    def __init__(self, layout: PipelineLayout):
        self.layout = layout
        self.pipeline_size = layout.num_stages

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(range(self.layout.num_stages))

    @property
    def num_reporters(self) -> int:
        return self.layout.num_stages

    def describe(self) -> str:
        return "emulator, one process"

    def local_streams(self, schedule: "Schedule") -> list[Iterable[Op]]:
        return list(schedule.streams())  # AMDP's streams share one scheduler run

    def sync_gather(self, values: Sequence[float], device: torch.device) -> list[float]:
        return [float(v) for v in values]  # the replay hands a sync step all its group's ops, in order

    def replica_gather(self, stage: int, local: Mapping[tuple[int, int], torch.Tensor]) -> list[torch.Tensor]:
        assert isinstance(self.layout, MultiPipelineLayout)
        return [local[replica] for replica in self.layout.replicas(stage)]  # every replica is here

    def report_sink(self, collector: ReportSink | None) -> ReportSink:
        assert collector is not None
        return collector

    def all_sum(self, values: Sequence[float]) -> list[float]:
        return list(values)

    def all_max(self, values: Sequence[float]) -> list[float]:
        return list(values)

    def barrier(self) -> None:
        pass

    def gather_rows(self, rows: Mapping[int, Sequence[float]]) -> list[tuple[int, list[float]]]:
        return [(stage, [float(x) for x in rows[stage]]) for stage in sorted(rows)]

    def link_latency(self, probe: torch.Tensor) -> float:
        """Median time to clone ``probe``: what a message costs here."""
        times = []
        for _ in range(CLONE_ROUNDS + 1):
            start = time.perf_counter()
            probe.clone()
            if probe.device.type == "cuda":
                torch.cuda.synchronize(probe.device)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])
