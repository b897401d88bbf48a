"""The end-of-run summary: what a finished run achieved, in a few lines.

Why: the per-interval lines answer "how is it going"; at the end a user wants one place
with the iterations and tokens trained, the time they took, the mean throughput, the final
training and validation loss and each stage's peak memory, without scrolling or parsing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


def memory_column(record: dict[str, Any]) -> tuple[str | None, list[float]]:
    """What a log line shows as memory: the allocator's peak on GPU, else the measured activation
    peak (``--log-activation-memory``), else nothing (``None``)."""
    if any(record["peak_memory_mb"]):
        return "peak mem", record["peak_memory_mb"]
    if "peak_activation_mb" in record:
        return "peak act", record["peak_activation_mb"]
    return None, []


@dataclass
class RunSummary:
    """Accumulated by :class:`~megatron.trainer.loop.logger.TrainingLogger` as records arrive."""

    start_iteration: int
    tokens_per_iteration: int
    last_iteration: int | None = None  # last logged training iteration
    train_loss: float = math.nan
    valid_loss: float = math.nan
    valid_iteration: int | None = None
    peak_memory_mb: list[float] = field(default_factory=list)
    memory_kind: str = "peak act"  # saved activations (CPU) or the allocator's peak (GPU)

    def add_training(self, record: dict) -> None:
        self.last_iteration = record["iteration"]
        self.train_loss = record["loss"]
        kind, mem = memory_column(record)
        if kind is None:  # no measure of memory in this run (CPU without --log-activation-memory)
            return
        self.memory_kind = kind
        if len(self.peak_memory_mb) != len(mem):
            self.peak_memory_mb = [0.0] * len(mem)
        self.peak_memory_mb = [max(a, b) for a, b in zip(self.peak_memory_mb, mem)]

    def add_evaluation(self, record: dict) -> None:
        if record["eval_split"] == "valid":
            self.valid_loss, self.valid_iteration = record["eval_loss"], record["iteration"]

    def iterations(self) -> int:
        return 0 if self.last_iteration is None else self.last_iteration - self.start_iteration

    def lines(self, wall_s: float, train_s: float) -> list[str]:
        """The summary; ``train_s`` excludes evaluation and checkpointing (as tokens/s does)."""
        iters = self.iterations()
        tokens = iters * self.tokens_per_iteration
        rate = tokens / train_s if train_s > 0 else 0.0
        last = self.last_iteration if self.last_iteration is not None else self.start_iteration
        valid = (f"{self.valid_loss:.6E} (iteration {self.valid_iteration})" if self.valid_iteration is not None
                 else "not evaluated (no --eval-interval)")
        mem = ", ".join(f"{m:.1f}" for m in self.peak_memory_mb)
        bar = "-" * 28 + " run summary " + "-" * 28
        return [
            bar,
            f" iterations: {iters} ({self.start_iteration} -> {last}) | tokens: {tokens:,} | "
            f"wall time: {wall_s:.1f} s (training {train_s:.1f} s) | mean tokens/s: {rate:,.0f}",
            f" final train loss: {self.train_loss:.6E} | final validation loss: {valid}",
            *([f" {self.memory_kind} (MB) per stage: [{mem}]"] if self.peak_memory_mb else []),
            "-" * len(bar),
        ]

    def record(self, wall_s: float, train_s: float) -> dict:
        """The same numbers as a dict (tests, tools)."""
        iters = self.iterations()
        tokens = iters * self.tokens_per_iteration
        return {"iterations": iters, "tokens": tokens, "wall_s": wall_s, "train_s": train_s,
                "tokens_per_s": tokens / train_s if train_s > 0 else 0.0, "train_loss": self.train_loss,
                "valid_loss": self.valid_loss, "peak_memory_mb": list(self.peak_memory_mb)}
