"""Flags of ``--optimizer basis-rotation`` (megatron.trainer.optim.basis_rotation), with their checks.

Kept apart from the optimizer module so that parsing flags does not depend on its code, like
the other ``*_args`` modules.
"""
from __future__ import annotations

import argparse

from megatron.trainer.config.errors import ConfigError

GEOMETRIES = ("bilateral", "unilateral")
SOURCES = ("second-moment", "momentum")


def add_basis_rotation_args(group: argparse._ArgumentGroup) -> None:
    """Add the rotation flags to the parser's optimizer group."""
    group.add_argument("--rotation-geometry", choices=GEOMETRIES, default="bilateral",
                       help="basis-rotation: rotate both sides of a weight matrix (U^T G V) or only the smaller one")
    group.add_argument("--rotation-source", choices=SOURCES, default="second-moment",
                       help="basis-rotation: eigenbasis of EMAs L = E[G G^T], R = E[G^T G] (two extra buffers) "
                            "or of the momentum (L ~ M M^T, R ~ M^T M)")
    group.add_argument("--rotation-refresh-interval", type=int, default=10, metavar="K",
                       help="basis-rotation: one power-iteration step + QR every K local steps (0: never, "
                            "identity basis = AdamW)")
    group.add_argument("--rotation-stage-aware", action="store_true",
                       help="basis-rotation: same total refresh budget, stage s of N refreshing at rate "
                            "2(N-s)/(K(N+1)) per step (proportional to its expected delay + 1)")


def check_basis_rotation_flags(args: argparse.Namespace) -> None:
    """One-line :class:`ConfigError` for a bad combination."""
    if args.optimizer != "basis-rotation":
        if args.rotation_stage_aware:
            raise ConfigError("--rotation-stage-aware needs --optimizer basis-rotation")
        return
    if args.rotation_refresh_interval < 0:
        raise ConfigError(f"--rotation-refresh-interval must be >= 0, got {args.rotation_refresh_interval}")
    if args.enable_optimizer_post_validation:
        raise ConfigError("--optimizer basis-rotation does not support --enable-optimizer-post-validation "
                          "(its rollback would have to undo basis statistics and refreshes)")
