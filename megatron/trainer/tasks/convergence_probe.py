"""``tools/plan_pipeline.py --probe-convergence N``: does an asynchronous schedule's speed survive
its staleness, for this model and data?

Why a probe: the planner ranks by tokens/s, but an asynchronous schedule's stale weights may need
more tokens to reach the same loss, and no formula gives that factor for a user's model and data.
The probe trains, for ``N`` updates each, 1F1B and every asynchronous schedule the plan ranked,
each at its best fitting candidate of the plan (pipeline depth, micro-batches per update, so the
weight-version drift is the one the full run would have), on the emulator (all stages in one
process, bitwise the distributed runtime), at the same depth and a reduced width (hidden size
divided by :data:`WIDTH_DIVISOR`, heads likewise), on the user's own data flags. It reports:

* **the loss gap at equal tokens**: each schedule's final probe loss (mean of the last
  :data:`WINDOW` updates) minus 1F1B's, after the same ``N`` updates of the same batches;
* **time to target**: the tokens each needs before its running mean (over :data:`WINDOW`
  updates) first reaches 1F1B's final one, divided by the plan's predicted tokens/s of its
  full-size candidate, next to 1F1B's own ``N`` updates at its predicted tokens/s.

With ``--probe-optimizers`` every candidate is probed with each listed optimizer (a delay-aware
one only on asynchronous schedules), against 1F1B with the run's ``--optimizer``: "paci + muon"
and "1f1b + adamw" side by side by time to the same target loss. The optimizer does not change
the plan's predicted tokens/s (its step is not in the cost model).

What it can tell: whether, at this depth, micro-batch count and learning-rate schedule, the
staleness costs a few percent of tokens or a multiple, and so whether an asynchronous schedule's
throughput lead is worth taking. What it cannot: the full width's sensitivity to staleness (a
wider model at the same learning rate may be more or less tolerant), anything past ``N`` updates
(early training is the most sensitive to stale gradients, so the probe tends to be pessimistic),
and data-parallel effects: the probe runs one replica (``--data-parallel-size 1``) with one
replica's micro-batches per update, so its batch per update is ``1/D`` of the full run's.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron.pipeline.planner.evaluate import CandidateResult
from megatron.pipeline.planner.report import flags as candidate_flags
from megatron.pipeline.schedules import schedule_class
from megatron.pipeline.schedules.sync.one_f_one_b import OneFOneBFlush
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.optim.registry import takes_schedule

WIDTH_DIVISOR = 4  # the probe's hidden size and heads: the user's over this
MIN_HIDDEN = 32
WINDOW = 5  # updates averaged for the final loss and the running mean


@dataclass(frozen=True)
class ProbeResult:
    """One schedule's probe: its losses per update and what the plan predicts for it."""

    schedule: str
    pipeline_model_parallel_size: int
    microbatches: int
    losses: list[float]
    tokens_per_update: int
    predicted_tokens_per_s: float
    optimizer: str = "adamw"


def running_mean(values: Sequence[float], window: int = WINDOW) -> list[float]:
    """Mean of each value with up to ``window - 1`` before it."""
    return [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def tokens_to_target(probe: ProbeResult, target: float, window: int = WINDOW) -> float | None:
    """Tokens until ``probe``'s running mean first reaches ``target`` (None: not within the probe)."""
    for i, loss in enumerate(running_mean(probe.losses, window)):
        if loss <= target:
            return float((i + 1) * probe.tokens_per_update)
    return None


def summary(probes: Sequence[ProbeResult], window: int = WINDOW) -> list[dict]:
    """One row per probe against the first (1F1B): final loss, gap, tokens and time to target."""
    reference = probes[0]
    target = running_mean(reference.losses, window)[-1]
    rows = []
    for p in probes:
        final = running_mean(p.losses, window)[-1]
        tokens = tokens_to_target(p, target, window)
        seconds = None if tokens is None or not p.predicted_tokens_per_s else tokens / p.predicted_tokens_per_s
        rows.append({"schedule": p.schedule, "optimizer": p.optimizer,
                     "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
                     "microbatches": p.microbatches, "final_loss": final, "loss_gap": final - target,
                     "tokens_to_target": tokens, "predicted_tokens_per_s": p.predicted_tokens_per_s,
                     "time_to_target_s": seconds})
    ref_time = rows[0]["time_to_target_s"]
    for row in rows:
        t = row["time_to_target_s"]
        row["speedup_vs_1f1b"] = ref_time / t if t and ref_time else None
    return rows


def probe_candidates(ranked_sync: Sequence[CandidateResult], ranked_async: Sequence[CandidateResult]
                     ) -> list[CandidateResult]:
    """1F1B's best fitting candidate, then each asynchronous schedule's best fitting one."""
    first = next((r for r in ranked_sync if r.fits and r.candidate.schedule == OneFOneBFlush.name), None)
    if first is None:
        raise ValueError("--probe-convergence compares with 1F1B, and no 1F1B candidate fits; "
                         f"add {OneFOneBFlush.name} to --schedules or raise --device-memory-gb")
    picked: dict[str, CandidateResult] = {}
    for r in ranked_async:
        if r.fits and r.candidate.virtual_stages == 1:
            picked.setdefault(r.candidate.schedule, r)
    return [first, *picked.values()]


def width_flags(config: RunPlan) -> list[str]:
    """The reduced width: hidden and heads over :data:`WIDTH_DIVISOR` (heads dividing hidden)."""
    heads = max(1, config.model.num_attention_heads // WIDTH_DIVISOR)
    hidden = max(MIN_HIDDEN, config.model.hidden_size // WIDTH_DIVISOR)
    hidden = -(-hidden // heads) * heads
    out = ["--hidden-size", str(hidden), "--num-attention-heads", str(heads), "--ffn-hidden-size", str(4 * hidden),
           "--kv-channels", str(hidden // heads)]
    if config.model.group_query_attention:
        groups = math.gcd(heads, config.model.num_query_groups)
        out += ["--num-query-groups", str(groups)]
    return out


def probe_runs(reference_optimizer: str, candidates: Sequence[CandidateResult],
               optimizers: Sequence[str] | None) -> list[tuple[CandidateResult, str]]:
    """(candidate, optimizer) pairs to probe: 1F1B with ``reference_optimizer`` first, then each
    optimizer on every candidate whose schedule it takes (1F1B's reference pair once)."""
    pairs = [(candidates[0], reference_optimizer)]
    for optimizer in optimizers or [reference_optimizer]:
        for result in candidates:
            asynchronous = schedule_class(result.candidate.schedule).traits.asynchronous
            if not any(r is result and o == optimizer for r, o in pairs) and takes_schedule(optimizer, asynchronous):
                pairs.append((result, optimizer))
    return pairs


def run_probe(user_argv: Sequence[str], config: RunPlan, result: CandidateResult, updates: int,
              workdir: Path, optimizer: str | None = None) -> ProbeResult:
    """Train ``result``'s candidate at the reduced width for ``updates`` updates on the emulator
    (with ``optimizer``; None: the run's)."""
    model = config.model
    cand = result.candidate
    optimizer = optimizer or config.optimizer.optimizer
    log = workdir / f"probe-{cand.schedule}-{cand.pipeline_model_parallel_size}-{optimizer}.jsonl"
    script = Path(__file__).resolve().parents[3] / "pretrain_gpt.py"
    command = [sys.executable, str(script), *user_argv, *width_flags(config), *candidate_flags(cand, model.num_layers),
               "--data-parallel-size", "1", "--tensor-model-parallel-size", "1",
               "--global-batch-size", str(cand.microbatches * cand.micro_batch_size),
               "--pipeline-executor", "emulator", "--train-iters", str(updates), "--log-interval", "1",
               "--eval-iters", "0", "--log-json", str(log), "--optimizer", optimizer]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode:
        tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"probe of {cand.schedule} with {optimizer} failed (exit {run.returncode}): {tail[0]}")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    losses = [float(r["loss"]) for r in records if "loss" in r and "eval_split" not in r]
    return ProbeResult(cand.schedule, cand.pipeline_model_parallel_size, cand.microbatches, losses,
                       cand.microbatches * cand.micro_batch_size * model.seq_length, result.tokens_per_s, optimizer)


def probe(user_argv: Sequence[str], config: RunPlan, ranked_sync: Sequence[CandidateResult],
          ranked_async: Sequence[CandidateResult], updates: int, optimizers: Sequence[str] | None = None
          ) -> list[dict]:
    """The probe's rows (module docstring), 1F1B with the run's optimizer first."""
    pairs = probe_runs(config.optimizer.optimizer, probe_candidates(ranked_sync, ranked_async), optimizers)
    with tempfile.TemporaryDirectory() as tmp:
        probes = [run_probe(user_argv, config, r, updates, Path(tmp), optimizer) for r, optimizer in pairs]
    return summary(probes)


def table(rows: Sequence[dict]) -> str:
    """The probe's rows for the terminal."""
    def num(v: float | None, fmt: str) -> str:
        return "not reached" if v is None else format(v, fmt)

    lines = ["convergence probe (reduced width, same depth; docs/planning.md says what it can tell)",
             f"{'schedule':<16} {'optimizer':<15} {'PP':>3} {'m':>4} {'final loss':>10} {'gap':>8} "
             f"{'tokens to target':>17} "
             f"{'pred. tok/s':>12} {'time to target s':>17} {'vs 1f1b':>8}"]
    for r in rows:
        lines.append(f"{r['schedule']:<16} {r['optimizer']:<15} {r['pipeline_model_parallel_size']:>3} "
                     f"{r['microbatches']:>4} "
                     f"{r['final_loss']:>10.4f} {r['loss_gap']:>+8.4f} {num(r['tokens_to_target'], '.0f'):>17} "
                     f"{r['predicted_tokens_per_s']:>12.1f} {num(r['time_to_target_s'], '.3f'):>17} "
                     f"{num(r['speedup_vs_1f1b'], '.3f'):>8}")
    return "\n".join(lines)
