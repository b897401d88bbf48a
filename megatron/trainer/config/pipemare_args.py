"""Flags of the ``pipemare`` schedule (megatron.pipeline.schedules.pipemare), with validation.

Each technique has its own flag and is off without it: ``--pipemare-lr-anneal-iters K`` (T1,
learning-rate rescheduling), ``--pipemare-discrepancy-decay D`` (T2, discrepancy correction),
``--pipemare-sync-warmup-iters W`` (PipeMareW: the first W iterations run 1F1B with a flush).
"""
from __future__ import annotations

import argparse
from typing import Any

from megatron.pipeline.schedules.pipemare import (
    DELAY_ALIASES,
    DELAY_MODELS,
    OPTION,
    PipeMareOptions,
    canonical_delay_model,
)

_FLAGS = ("pipemare_lr_anneal_iters", "pipemare_discrepancy_decay", "pipemare_sync_warmup_iters")


def add_pipemare_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("pipemare")
    g.add_argument("--pipemare-lr-anneal-iters", type=int, default=None, metavar="K",
                   help="T1: stage i updates with lr / tau_i^(1 - min(k/K, 1)) (k: update since asynchrony began)")
    g.add_argument("--pipemare-discrepancy-decay", type=float, default=None, metavar="D",
                   help="T2: backwards read w - d * delta (d: the updates the micro-batch crossed since its forward, "
                        "tau_i with --pipemare-delay-model paper; never on a zero-delay stage), "
                        "delta an EMA of the per-update weight change "
                        "with decay D^(1/tau_i); the paper suggests D near 0.1-0.5")
    g.add_argument("--pipemare-sync-warmup-iters", type=int, default=0, metavar="W",
                   help="PipeMareW: the first W iterations run synchronously (1F1B with a flush)")
    g.add_argument("--pipemare-delay-model", choices=(*DELAY_MODELS, *DELAY_ALIASES), default="stream",
                   help="tau of 0-based stage s: 'stream' (default) is this 1F1B stream's real delay "
                        "ceil((N-1-s)/a) (N stages, a micro-batches per update; 0 on the last stage); "
                        "'paper' is Table 1's fine-grained ceil((2(N-s)-1)/a), about twice as long here; "
                        "'1f1b' is the old name of 'stream'. T2 never corrects a stage whose stream delay is 0")


def validate_pipemare_args(args: argparse.Namespace) -> None:
    """One-line :class:`ArgumentError` when a PipeMare flag is given to another schedule (the
    schedule's own check_config judges the values)."""
    from megatron.trainer.config.errors import ArgumentError

    if args.pipeline_schedule == "pipemare":
        return
    for flag in _FLAGS:
        if getattr(args, flag, None) not in (None, 0):
            raise ArgumentError(f"--{flag.replace('_', '-')} needs --pipeline-schedule pipemare")


def pipemare_options(args: argparse.Namespace) -> dict[str, Any]:
    """``ScheduleConfig.options`` entries for these flags."""
    if getattr(args, "pipeline_schedule", None) != "pipemare":
        return {}
    return {OPTION: PipeMareOptions(
        lr_anneal_iters=args.pipemare_lr_anneal_iters, discrepancy_decay=args.pipemare_discrepancy_decay,
        sync_warmup_iters=args.pipemare_sync_warmup_iters,
        delay_model=canonical_delay_model(args.pipemare_delay_model))}
