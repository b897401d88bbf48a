"""Flags of the ``amdp`` schedule (megatron.pipeline.schedules.amdp), with validation.

``--amdp-optimizer-state sharded`` (the default, the paper's §3.4) keeps AdamW state (moments,
fp32 masters) for 1/P of every hosted logical stage on each of its P = D/2 replicas and
all-gathers the stepped ranges after the window step; ``replicated`` keeps the whole state on
every replica (the paper's "without ZeRO" ablation). Both give the same bits. Basis rotation
rotates whole matrices, so its state cannot be split by elements: it defaults to
``replicated`` and refuses ``sharded``.
"""
from __future__ import annotations

import argparse

OPTIMIZER_STATE = ("sharded", "replicated")


def add_amdp_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("amdp")
    g.add_argument("--amdp-optimizer-state", choices=OPTIMIZER_STATE, default=None,
                   help="AMDP: shard AdamW state over the D/2 replicas of each stage (default, ZeRO-1 as in "
                        "the paper) or keep it whole on every replica")


def validate_amdp_args(args: argparse.Namespace) -> None:
    """One-line :class:`ArgumentError` for an AMDP flag without AMDP, or sharding with an
    optimizer whose state is not element-wise (basis rotation rotates whole matrices)."""
    from megatron.trainer.config.errors import ArgumentError

    state = getattr(args, "amdp_optimizer_state", None)
    if args.pipeline_schedule != "amdp":
        if state is not None:
            raise ArgumentError("--amdp-optimizer-state needs --pipeline-schedule amdp")
        return
    elementwise = getattr(args, "optimizer", "adamw") == "adamw"
    if state is None:  # the default: sharded where the optimizer allows it
        args.amdp_optimizer_state = state = "sharded" if elementwise else "replicated"
    if state == "sharded" and not elementwise:
        raise ArgumentError(f"--amdp-optimizer-state sharded: --optimizer {args.optimizer} is not element-wise; "
                            "use --amdp-optimizer-state replicated")


def amdp_shards_optimizer(args: argparse.Namespace) -> bool:
    """Whether this run's stage optimizers hold only their replica's range (see module doc)."""
    return (getattr(args, "pipeline_schedule", None) == "amdp"
            and getattr(args, "amdp_optimizer_state", None) == "sharded")
