"""Megatron-LM's mixed-precision flags (``--fp16`` and its loss scaling), with their checks.

``--fp16`` trains fp16 weights and activations with fp32 master weights (the same optimizer
path as ``--bf16``) and loss scaling: static with ``--loss-scale``, else megatron-core's dynamic
scaler (``--initial-loss-scale``, ``--min-loss-scale``, ``--loss-scale-window``,
``--hysteresis``). Synchronous schedules keep one scale for the pipeline, asynchronous ones one
per stage (:mod:`megatron.pipeline.runtime.loss_scaling`). In half precision, optimizer
post-validation rolls back from a backup by default (``--optimizer-post-validation-exact``):
the in-place inverse leaves the fp32 masters a few ulp off, and re-casting them to bf16/fp16
flips some weights by a whole half-precision ulp, a perturbation the training then amplifies
(docs/design.md). ``--optimizer-post-validation-in-place`` keeps the in-place rollback.
"""
from __future__ import annotations

import argparse

from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.values import FlagValue

from megatron.pipeline.runtime.loss_scaling import LossScaleConfig
from megatron.trainer.config.job_config import JobConfig

_DYNAMIC_DEFAULTS = {"initial_loss_scale": 2.0**32, "min_loss_scale": 1.0, "loss_scale_window": 1000,
                     "hysteresis": 2}


def add_mixed_precision_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 model and activations, fp32 master weights, loss scaling")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="--fp16: static loss scale (default: dynamic loss scaling)")
    g.add_argument("--initial-loss-scale", type=float, default=None, help="dynamic loss scaling: first scale (2**32)")
    g.add_argument("--min-loss-scale", type=float, default=None, help="dynamic loss scaling: lower bound (1.0)")
    g.add_argument("--loss-scale-window", type=int, default=None,
                   help="dynamic loss scaling: clean steps before the scale doubles (1000)")
    g.add_argument("--hysteresis", type=int, default=None,
                   help="dynamic loss scaling: overflows before the scale halves (2)")
    g.add_argument("--optimizer-post-validation-in-place", action="store_true",
                   help="with --bf16/--fp16: roll back in place instead of from a backup (the default in half "
                        "precision); not bitwise, and the drift grows through the half-precision casts")


def _may_turn_asynchronous(name: str) -> bool:
    from megatron.pipeline.schedules import ScheduleConfigError, schedule_class

    try:
        return bool(getattr(schedule_class(name), "include_async", False))
    except ScheduleConfigError:
        return False  # an unknown name is refused with the schedule's checks


def check_mixed_precision_flags(args: argparse.Namespace) -> dict[str, FlagValue]:
    """One-line :class:`ConfigError` for a bad combination; the defaults it fills (dynamic loss
    scaling's, and exact rollback in half precision)."""
    if args.fp16 and args.bf16:
        raise ConfigError("--fp16 and --bf16 are mutually exclusive")
    if args.fp16 and _may_turn_asynchronous(args.pipeline_schedule):
        raise ConfigError(f"--fp16 with --pipeline-schedule {args.pipeline_schedule}: the loss scaler is "
                          "pipeline-wide or stage-local from the start, and the choice may switch from one "
                          "to the other; use --bf16 or --pipeline-schedule auto")
    flags = vars(args)  # the flags by dest
    given = [name for name in ("loss_scale", *_DYNAMIC_DEFAULTS) if flags[name] is not None]
    if given and not args.fp16:
        raise ConfigError(f"--{given[0].replace('_', '-')} needs --fp16 (loss scaling is for fp16 only)")
    if args.loss_scale is not None:
        dynamic = [name for name in _DYNAMIC_DEFAULTS if flags[name] is not None]
        if dynamic:
            raise ConfigError(f"--{dynamic[0].replace('_', '-')} is for dynamic loss scaling; "
                              f"--loss-scale {args.loss_scale} is static")
        if not args.loss_scale > 0:
            raise ConfigError(f"--loss-scale must be > 0, got {args.loss_scale}")
    filled: dict[str, FlagValue] = {name: default for name, default in _DYNAMIC_DEFAULTS.items() if flags[name] is None}
    scale = {**{name: flags[name] for name in _DYNAMIC_DEFAULTS}, **filled}
    if not 0 < scale["min_loss_scale"] <= scale["initial_loss_scale"]:
        raise ConfigError(f"need 0 < --min-loss-scale {scale['min_loss_scale']} <= --initial-loss-scale "
                          f"{scale['initial_loss_scale']}")
    if scale["loss_scale_window"] < 1 or scale["hysteresis"] < 1:
        raise ConfigError("--loss-scale-window and --hysteresis must be >= 1")
    return {**filled, **_resolve_rollback_mode(args, ConfigError)}


def _resolve_rollback_mode(args: argparse.Namespace, error: type[Exception]) -> dict[str, FlagValue]:
    """Exact (backup) rollback by default in half precision, in place otherwise (what it sets)."""
    in_place = args.optimizer_post_validation_in_place
    if in_place and args.optimizer_post_validation_exact:
        raise error("--optimizer-post-validation-in-place and --optimizer-post-validation-exact are mutually exclusive")
    if in_place and not (args.bf16 or args.fp16):
        raise error("--optimizer-post-validation-in-place is for --bf16/--fp16 (in fp32 it is the default)")
    if in_place and not args.enable_optimizer_post_validation:
        raise error("--optimizer-post-validation-in-place needs --enable-optimizer-post-validation")
    if (args.bf16 or args.fp16) and args.enable_optimizer_post_validation and not in_place:
        return {"optimizer_post_validation_exact": True}
    return {}


def loss_scale_config(config: JobConfig, asynchronous: bool) -> LossScaleConfig | None:
    """The stages' loss scaling for this run (None without ``--fp16``)."""
    precision = config.precision
    if not precision.fp16:
        return None
    return LossScaleConfig(static_scale=precision.loss_scale, initial_scale=precision.initial_loss_scale,
                           min_scale=precision.min_loss_scale, window=precision.loss_scale_window,
                           hysteresis=precision.hysteresis, stage_local=asynchronous)

