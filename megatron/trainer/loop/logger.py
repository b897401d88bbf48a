"""Training log lines and ``--log-json`` records, built from every stage's reports."""
from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from megatron.pipeline.runtime.report import StageReport
from megatron.trainer.loop.run_summary import RunSummary, memory_column


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
    stream: IO[str] = None  # type: ignore[assignment]  # None: sys.stdout when the logger is made
    last_record: dict[str, Any] | None = None  # only the latest: a long run must not grow
    start_iteration: int = 0  # a resumed run continues the iteration count
    tensorboard_dir: str | None = None
    # Samples consumed before an iteration (a batch-size rampup); None: a constant batch.
    samples_before: Callable[[int], int] | None = None
    flops_per_sample: float = 0.0  # --log-throughput: model FLOPs of one sample's training
    num_gpus: int = 1  # ranks the throughput is shared by
    log_params_norm: bool = False
    log_activation_memory: bool = False  # records carry peak_activation_mb (the meter measured bytes)
    wandb: Any = None  # a wandb run (--wandb-project), rank 0 only
    # Asynchronous schedules: every stage steps on its own clock, so its lr and grad norm are
    # logged per stage (synchronous stages share both).
    per_stage_optimizer: bool = False
    aux_loss_name: str | None = None  # a task's separately logged loss part ("sop loss")
    # Every training record's "embeddings": tied or not (and why), the tied parameter count.
    embeddings: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.stream is None:  # looked up now, not at import: tests and tools swap sys.stdout
            self.stream = sys.stdout
        self._start = time.perf_counter()
        self._wall_start = self._start
        self._last_time = self._start
        self._last_iteration = self.start_iteration
        self.summary = RunSummary(self.start_iteration, self.tokens_per_iteration)
        self._json: IO[str] | None = None
        if self.json_path:
            self._json = open_json_log(self.json_path, self.start_iteration, self.stream)
        self._tensorboard = TensorBoardScalars(self.tensorboard_dir) if self.tensorboard_dir else None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Evaluation and checkpointing do not count as training time (tokens/s, ETA)."""
        began = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - began
            self._start += spent
            self._last_time += spent

    def log_evaluation(self, iteration: int, split: str, loss_sum: float, tokens: int) -> dict[str, Any]:
        """Megatron's evaluation line, a ``--log-json`` record and TensorBoard scalars."""
        loss = loss_sum / tokens if tokens else math.nan
        ppl = math.exp(min(loss, 20.0)) if math.isfinite(loss) else math.nan
        name = {"valid": "validation", "test": "test"}.get(split, split)
        where = "the end of training" if iteration == self.train_iters else f"iteration {iteration}"
        line = f" {name} loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
        bar = "-" * len(line)
        print(f"{bar}\n{line}\n{bar}", file=self.stream, flush=True)
        record = {"iteration": iteration, "eval_split": split, "eval_loss": loss, "eval_ppl": ppl, "eval_tokens": tokens}
        self._write(record)
        self.summary.add_evaluation(record)
        if self._tensorboard is not None:
            self._tensorboard.add({f"{split}/lm-loss": loss, f"{split}/lm-loss-ppl": ppl}, iteration)
        return record

    def _write(self, record: dict[str, Any]) -> None:
        self.last_record = record
        if self._json is not None:
            self._json.write(json.dumps(record) + "\n")
            self._json.flush()

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
        samples = self._consumed(iteration) - self._consumed(iteration - iters)
        tokens = samples * self.tokens_per_iteration // self.samples_per_iteration
        tokens_per_s = tokens / interval if interval > 0 else 0.0
        elapsed = now - self._start
        eta = elapsed / max(1, iteration - self.start_iteration) * (self.train_iters - iteration)
        record: dict[str, Any] = {
            "iteration": iteration,
            "consumed_samples": self._consumed(iteration),
            "global_batch_size": self._consumed(iteration) - self._consumed(iteration - 1),
            "loss": loss_sum / loss_count if loss_count else math.nan,
            "lr": stage0[0].lr if stage0 else math.nan,
            "grad_norm": last[0].grad_norm if last else math.nan,
            "lr_per_stage": _per_stage(reports, self.num_stages, lambda rs: rs[0].lr if rs else math.nan),
            "grad_norm_per_stage": _per_stage(reports, self.num_stages, lambda rs: rs[0].grad_norm if rs else math.nan),
            "skipped_updates": _per_stage(reports, self.num_stages, lambda rs: max(r.skipped for r in rs)),
            "tokens_per_s": tokens_per_s,
            "iteration_time_ms": 1000.0 * interval / iters,
            "elapsed_s": elapsed,
            "eta_s": eta,
            "peak_inflight_microbatches": _per_stage(reports, self.num_stages, lambda rs: max(r.act_peak_count for r in rs)),
            "peak_memory_mb": _per_stage(reports, self.num_stages, lambda rs: max(r.mem_peak_bytes for r in rs) / 2**20),
            "drift_max": _per_stage(reports, self.num_stages, lambda rs: max(r.drift_max for r in rs)),
            "drift_mean": _per_stage(
                reports, self.num_stages,
                lambda rs: sum(r.drift_sum for r in rs) / max(1, sum(r.drift_count for r in rs))),
            "loss_scale": _per_stage(reports, self.num_stages, lambda rs: min(r.loss_scale for r in rs)),
        }
        if self.log_activation_memory:  # --log-activation-memory: measured bytes (else no hook ran)
            record["peak_activation_mb"] = _per_stage(reports, self.num_stages,
                                                      lambda rs: max(r.act_peak_bytes for r in rs) / 2**20)
        if self.flops_per_sample:
            record["tflops_per_gpu"] = self.flops_per_sample * samples / max(interval, 1e-12) / self.num_gpus / 1e12
        if self.log_params_norm:  # replicas hold the same weights: one report per stage
            record["params_norm"] = math.sqrt(sum(_per_stage(reports, self.num_stages, lambda rs: rs[0].param_sq)))
        aux_count = sum(r.aux_loss_count for r in reports)
        if self.aux_loss_name and aux_count:
            record[_json_key(self.aux_loss_name)] = sum(r.aux_loss_sum for r in reports) / aux_count
        if self.embeddings is not None:
            record["embeddings"] = self.embeddings
        self._print(record)
        self._write(record)
        self.summary.add_training(record)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=iteration)
        if self._tensorboard is not None:
            aux_key = _json_key(self.aux_loss_name) if self.aux_loss_name else None
            self._tensorboard.add_training(record, iteration, self.per_stage_optimizer, aux_key)

    def _print(self, r: dict[str, Any]) -> None:
        mem_kind, mem = memory_column(r)
        parts = [
            f" iteration {r['iteration']:8d}/{self.train_iters:8d}",
            f"consumed samples: {r['consumed_samples']:10d}",
            f"elapsed time per iteration (ms): {r['iteration_time_ms']:.1f}",
            f"learning rate: {r['lr']:.6E}",
            f"lm loss: {r['loss']:.6E}",
        ]
        if self.aux_loss_name and _json_key(self.aux_loss_name) in r:
            parts.append(f"{self.aux_loss_name}: {r[_json_key(self.aux_loss_name)]:.6E}")
        parts += [
            f"grad norm: {r['grad_norm']:.3f}",
            f"tokens/s: {r['tokens_per_s']:.0f}",
            f"elapsed: {_hms(r['elapsed_s'])} ETA: {_hms(r['eta_s'])}",
        ]
        if mem_kind is not None:
            parts.append(f"{mem_kind} (MB) per stage: [{', '.join(f'{m:.1f}' for m in mem)}]")
        if any(scale != 1.0 for scale in r["loss_scale"]):  # --fp16
            parts.append(f"loss scale per stage: [{', '.join(f'{x:.1f}' for x in r['loss_scale'])}]")
        if "tflops_per_gpu" in r:
            parts.append(f"throughput per GPU (TFLOP/s/GPU): {r['tflops_per_gpu']:.1f}")
        if "params_norm" in r:
            parts.append(f"params norm: {r['params_norm']:.3f}")
        if self.per_stage_optimizer:
            parts.append(f"lr per stage: [{', '.join(f'{v:.3E}' for v in r['lr_per_stage'])}]")
            parts.append(f"grad norm per stage: [{', '.join(f'{v:.3f}' for v in r['grad_norm_per_stage'])}]")
        if any(r["skipped_updates"]):
            parts.append(f"skipped updates per stage: {r['skipped_updates']}")
        if self.log_drift:
            parts.append(f"drift max: {r['drift_max']} mean: [{', '.join(f'{d:.2f}' for d in r['drift_mean'])}]")
        print(" | ".join(parts), file=self.stream, flush=True)

    def _consumed(self, iteration: int) -> int:
        """Samples consumed by the first ``iteration`` iterations."""
        if self.samples_before is not None:
            return self.samples_before(iteration)
        return iteration * self.samples_per_iteration

    def summary_lines(self) -> list[str]:
        now = time.perf_counter()
        return self.summary.lines(wall_s=now - self._wall_start, train_s=now - self._start)

    def log_summary(self) -> None:
        """The end-of-run summary (iterations, tokens, time, throughput, losses, memory)."""
        print("\n".join(self.summary_lines()), file=self.stream, flush=True)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if self._json is not None:
            self._json.close()
            self._json = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


class TensorBoardScalars:
    """``--tensorboard-dir``: the logged numbers as TensorBoard scalars (rank 0 only).

    Per-stage series (drift, memory) get one tag per stage, so a plot shows all stages.
    """

    def __init__(self, directory: str):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=directory)

    def add(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def add_training(self, r: dict[str, Any], step: int, per_stage_optimizer: bool = False,
                     aux_key: str | None = None) -> None:
        scalars = {"train/lm-loss": r["loss"], "train/learning-rate": r["lr"], "train/grad-norm": r["grad_norm"],
                   "throughput/tokens-per-s": r["tokens_per_s"], "throughput/iteration-time-ms": r["iteration_time_ms"]}
        if aux_key in r:
            scalars[f"train/{aux_key.replace('_', '-')}"] = r[aux_key]
        if per_stage_optimizer:
            for stage, (lr, norm) in enumerate(zip(r["lr_per_stage"], r["grad_norm_per_stage"])):
                scalars[f"learning-rate/stage{stage}"] = lr
                scalars[f"grad-norm/stage{stage}"] = norm
        for stage in range(len(r["drift_max"])):
            scalars[f"drift/max-stage{stage}"] = r["drift_max"][stage]
            scalars[f"drift/mean-stage{stage}"] = r["drift_mean"][stage]
            if "peak_activation_mb" in r:
                scalars[f"memory/peak-activation-mb-stage{stage}"] = r["peak_activation_mb"][stage]
            if r["peak_memory_mb"][stage]:
                scalars[f"memory/peak-mb-stage{stage}"] = r["peak_memory_mb"][stage]
            scalars[f"skipped-updates/stage{stage}"] = r["skipped_updates"][stage]
            if r["loss_scale"][stage] != 1.0:  # --fp16
                scalars[f"loss-scale/stage{stage}"] = r["loss_scale"][stage]
        self.add(scalars, step)

    def close(self) -> None:
        self.writer.close()


def _json_key(name: str) -> str:
    """A log label as a JSON/record key: "sop loss" -> "sop_loss"."""
    return name.replace(" ", "_").replace("-", "_")


def open_json_log(path: str, start_iteration: int, stream: IO[str]) -> IO[str]:
    """Open ``--log-json PATH`` so that two runs never mix in one file.

    A fresh run (``start_iteration`` 0) starts a new file: an earlier run's non-empty log at
    PATH is kept, renamed to ``PATH.1`` (or the first free ``PATH.N``). A run resumed from a
    checkpoint at iteration k continues its own log: it keeps the records up to k and appends;
    records after k (an interrupted attempt that the checkpoint does not include) move, with
    the whole previous file, to ``PATH.N``.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not (target.is_file() and target.stat().st_size > 0):
        return open(target, "w")
    lines = target.read_text().splitlines(keepends=True)
    kept = [line for line in lines if start_iteration and _iteration_of(line) <= start_iteration]
    if len(kept) == len(lines):
        return open(target, "a")
    n = 1
    while Path(f"{path}.{n}").exists():
        n += 1
    target.rename(f"{path}.{n}")
    print(f"[megatron-async] --log-json: the previous log {path} is now {path}.{n}"
          + (f"; {path} keeps its records up to iteration {start_iteration}" if kept else ""),
          file=stream, flush=True)
    out = open(target, "w")
    out.writelines(kept)
    out.flush()
    return out


def _iteration_of(line: str) -> float:
    try:
        return float(json.loads(line).get("iteration", math.inf))
    except (json.JSONDecodeError, AttributeError):
        return math.inf


def _hms(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
