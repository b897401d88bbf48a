"""Flags of optimizer post-validation (Zero Bubble §4) and its testing hook, with validation.

``--enable-optimizer-post-validation`` replaces the synchronous optimizer step that ends each
iteration of a synchronous schedule by PSTEP + VALIDATE (:mod:`megatron.pipeline.post_validation`):
no pipeline-wide barrier, an optimistic step that is rolled back in place when the global
state asks for clipping or a skip. ``--optimizer-post-validation-exact`` rolls back from a
backup of the optimizer state instead (bitwise; one more copy of the state in memory).
``--inject-nonfinite-loss MICROBATCH`` makes that global micro-batch's loss NaN (testing).
"""
from __future__ import annotations

import argparse
from typing import Any

from megatron.pipeline.post_validation import POST_VALIDATION


def add_post_validation_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("optimizer post-validation")
    g.add_argument("--enable-optimizer-post-validation", action="store_true",
                   help="synchronous schedules: replace the pipeline-wide optimizer step by Zero Bubble's "
                        "post-validation (optimistic step, validated during the next warm-up, rolled back "
                        "when clipping or a non-finite gradient requires it)")
    g.add_argument("--optimizer-post-validation-exact", action="store_true",
                   help="roll back from a backup of weights and Adam moments (bitwise) instead of the "
                        "in-place arithmetic inverse (within a few ulp); costs one more copy of the state; the default "
                        "with --bf16/--fp16 (see --optimizer-post-validation-in-place)")
    g.add_argument("--inject-nonfinite-loss", action="append", type=int, default=[], metavar="MICROBATCH",
                   help="testing: the loss of this global micro-batch (0-based) becomes NaN; repeatable")


def validate_post_validation_args(args: argparse.Namespace) -> None:
    """One-line :class:`ArgumentError` for a bad combination."""
    from megatron.pipeline.schedules import ScheduleConfigError, schedule_class
    from megatron.trainer.config.errors import ArgumentError

    enabled = getattr(args, "enable_optimizer_post_validation", False)
    if getattr(args, "optimizer_post_validation_exact", False) and not enabled:
        raise ArgumentError("--optimizer-post-validation-exact needs --enable-optimizer-post-validation")
    for mb in getattr(args, "inject_nonfinite_loss", []):
        if mb < 0:
            raise ArgumentError(f"--inject-nonfinite-loss expects a micro-batch index >= 0, got {mb}")
    if not enabled:
        return
    try:
        asynchronous = schedule_class(args.pipeline_schedule).asynchronous
    except ScheduleConfigError:
        return  # the schedule check reports the unknown name
    if asynchronous:
        raise ArgumentError(
            f"--enable-optimizer-post-validation needs a synchronous --pipeline-schedule (1f1b, gpipe, "
            f"interleaved-1f1b, zb-*); {args.pipeline_schedule} steps stage-locally without a global step")


def post_validation_options(args: argparse.Namespace) -> dict[str, Any]:
    """``ScheduleConfig.options`` entries for these flags."""
    return {POST_VALIDATION: True} if getattr(args, "enable_optimizer_post_validation", False) else {}
