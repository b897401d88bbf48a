"""Flags of ``--optimizer delay-nesterov`` (megatron.trainer.optim.delay_nesterov), with their checks.

Kept apart from the optimizer module so that parsing flags does not depend on its code, like
the other ``*_args`` modules.
"""
from __future__ import annotations

import argparse

from megatron.trainer.config.errors import ConfigError

MAX_MOMENTUM, MOMENTUM_DECAY = 0.99, 0.004


def add_delay_nesterov_args(group: argparse._ArgumentGroup) -> None:
    """Add the look-ahead's flags to the parser's optimizer group."""
    group.add_argument("--lookahead-max-momentum", type=float, default=MAX_MOMENTUM,
                       help="delay-nesterov: beta1 of a stage with delay tau of N stages is "
                            "beta1 + tau (MAX - beta1) / N (--adam-beta1 <= MAX < 1)")
    group.add_argument("--nadam-momentum-decay", type=float, default=MOMENTUM_DECAY,
                       help="delay-nesterov: NAdam's momentum schedule mu_t = beta1 (1 - 0.5 * 0.96^(t psi))")


def check_delay_nesterov_flags(args: argparse.Namespace, gradient_delays: tuple[int, ...] | None) -> None:
    """One-line :class:`ConfigError` for a bad combination; ``gradient_delays``: the schedule
    policy's declared per-stage delays (None: a synchronous schedule)."""
    if args.optimizer != "delay-nesterov":
        for flag, value, default in (("--lookahead-max-momentum", args.lookahead_max_momentum, MAX_MOMENTUM),
                                     ("--nadam-momentum-decay", args.nadam_momentum_decay, MOMENTUM_DECAY)):
            if value != default:
                raise ConfigError(f"{flag} needs --optimizer delay-nesterov")
        return
    if gradient_delays is None:
        raise ConfigError(f"--optimizer delay-nesterov adapts the look-ahead to a stage's gradient delay; "
                          f"--pipeline-schedule {args.pipeline_schedule} declares none (use paci, async-1f1b, "
                          "pipedream-2bw, pipemare or amdp)")
    if args.lookahead_max_momentum < args.adam_beta1:
        raise ConfigError(f"--lookahead-max-momentum {args.lookahead_max_momentum} is below --adam-beta1 "
                          f"{args.adam_beta1}")
