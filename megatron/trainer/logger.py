"""Training log lines and ``--log-json`` records, built from every stage's reports."""
from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from megatron.pipeline.report import StageReport


class ReportCollector:
    """Gathers the reports of all stages x replicas for an update, then hands them on."""

    def __init__(self, expected: int, on_complete: Callable[[int, list[StageReport]], None]):
        self.expected = expected
        self.on_complete = on_complete
        self._pending: dict[int, list[StageReport]] = {}

    def submit(self, report: StageReport, replica: int = 0) -> None:
        bucket = self._pending.setdefault(report.update, [])
        bucket.append(report)
        if len(bucket) == self.expected:
            del self._pending[report.update]
            self.on_complete(report.update, bucket)


def _per_stage(reports: list[StageReport], num_stages: int, fn: Callable[[list[StageReport]], Any]) -> list[Any]:
    by_stage: list[list[StageReport]] = [[] for _ in range(num_stages)]
    for r in reports:
        by_stage[r.stage].append(r)
    return [fn(rs) for rs in by_stage]


@dataclass
class TrainingLogger:
    """Megatron-style progress lines; one JSON object per logged iteration."""

    num_stages: int
    train_iters: int
    samples_per_iteration: int
    tokens_per_iteration: int
    log_drift: bool = False
    json_path: str | None = None
    stream: IO[str] = sys.stdout
    records: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._start = time.perf_counter()
        self._last_time = self._start
        self._last_iteration = 0
        self._json: IO[str] | None = None
        if self.json_path:
            Path(self.json_path).parent.mkdir(parents=True, exist_ok=True)
            self._json = open(self.json_path, "a")

    def log_update(self, update: int, reports: list[StageReport]) -> None:
        now = time.perf_counter()
        iteration = update + 1
        iters = max(1, iteration - self._last_iteration)
        interval = now - self._last_time
        self._last_time, self._last_iteration = now, iteration
        loss_sum = sum(r.loss_sum for r in reports)
        loss_count = sum(r.loss_count for r in reports)
        last = [r for r in reports if r.stage == self.num_stages - 1]
        stage0 = [r for r in reports if r.stage == 0]
        tokens_per_s = self.tokens_per_iteration * iters / interval if interval > 0 else 0.0
        elapsed = now - self._start
        eta = elapsed / iteration * (self.train_iters - iteration)
        record: dict[str, Any] = {
            "iteration": iteration,
            "consumed_samples": iteration * self.samples_per_iteration,
            "loss": loss_sum / loss_count if loss_count else math.nan,
            "lr": stage0[0].lr if stage0 else math.nan,
            "grad_norm": last[0].grad_norm if last else math.nan,
            "skipped_updates": _per_stage(reports, self.num_stages, lambda rs: max(r.skipped for r in rs)),
            "tokens_per_s": tokens_per_s,
            "iteration_time_ms": 1000.0 * interval / iters,
            "elapsed_s": elapsed,
            "eta_s": eta,
            "peak_activation_mb": _per_stage(reports, self.num_stages, lambda rs: max(r.act_peak_bytes for r in rs) / 2**20),
            "peak_inflight_microbatches": _per_stage(reports, self.num_stages, lambda rs: max(r.act_peak_count for r in rs)),
            "peak_memory_mb": _per_stage(reports, self.num_stages, lambda rs: max(r.mem_peak_bytes for r in rs) / 2**20),
            "drift_max": _per_stage(reports, self.num_stages, lambda rs: max(r.drift_max for r in rs)),
            "drift_mean": _per_stage(
                reports, self.num_stages,
                lambda rs: sum(r.drift_sum for r in rs) / max(1, sum(r.drift_count for r in rs))),
        }
        self.records.append(record)
        self._print(record)
        if self._json is not None:
            self._json.write(json.dumps(record) + "\n")
            self._json.flush()

    def _print(self, r: dict[str, Any]) -> None:
        mem = r["peak_memory_mb"] if any(r["peak_memory_mb"]) else r["peak_activation_mb"]
        mem_kind = "peak mem" if any(r["peak_memory_mb"]) else "peak act"
        parts = [
            f" iteration {r['iteration']:8d}/{self.train_iters:8d}",
            f"consumed samples: {r['consumed_samples']:10d}",
            f"elapsed time per iteration (ms): {r['iteration_time_ms']:.1f}",
            f"learning rate: {r['lr']:.6E}",
            f"lm loss: {r['loss']:.6E}",
            f"grad norm: {r['grad_norm']:.3f}",
            f"tokens/s: {r['tokens_per_s']:.0f}",
            f"elapsed: {_hms(r['elapsed_s'])} ETA: {_hms(r['eta_s'])}",
            f"{mem_kind} (MB) per stage: [{', '.join(f'{m:.1f}' for m in mem)}]",
        ]
        if any(r["skipped_updates"]):
            parts.append(f"skipped updates per stage: {r['skipped_updates']}")
        if self.log_drift:
            parts.append(f"drift max: {r['drift_max']} mean: [{', '.join(f'{d:.2f}' for d in r['drift_mean'])}]")
        print(" | ".join(parts), file=self.stream, flush=True)

    def close(self) -> None:
        if self._json is not None:
            self._json.close()
            self._json = None


def _hms(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
