"""Optimizer registry: ``--optimizer NAME`` looks the stage optimizer's builder up here.

Every builder gets the run's flags, the stage's named parameters, the stage index and the
ranges an AMDP replica owns, and returns an optimizer with the stage-local step interface of
:class:`~megatron.trainer.optim.adamw.StageAdamW` (step through ``p.data``, exact backups for
post-validation rollback). Adding an optimizer is one builder and one line here.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from megatron.trainer.optim.adamw import Shards, StageAdamW
from megatron.trainer.optim.basis_rotation import BasisRotationAdamW, RotationConfig

NamedParameters = list[tuple[str, torch.nn.Parameter]]
OptimizerBuilder = Callable[[argparse.Namespace, NamedParameters, int, "Shards | None"], StageAdamW]


def _hyperparameters(args: argparse.Namespace) -> dict:
    return dict(lr=args.lr, weight_decay=args.weight_decay, betas=(args.adam_beta1, args.adam_beta2),
                eps=args.adam_eps)


def _adamw(args: argparse.Namespace, named: NamedParameters, stage: int, shards: Shards | None) -> StageAdamW:
    return StageAdamW(named, exact=args.optimizer_post_validation_exact, shards=shards,
                      fused=args.adam_kernel == "fused", **_hyperparameters(args))


def _basis_rotation(args: argparse.Namespace, named: NamedParameters, stage: int,
                    shards: Shards | None) -> StageAdamW:
    """Gets the stage index and the pipeline depth: the stage-aware refresh budget depends on them."""
    rotation = RotationConfig(
        geometry=args.rotation_geometry, source=args.rotation_source,
        refresh_interval=args.rotation_refresh_interval, stage_aware=args.rotation_stage_aware,
        stage=stage, num_stages=args.pipeline_model_parallel_size)
    return BasisRotationAdamW(named, rotation=rotation, **_hyperparameters(args))


OPTIMIZERS: dict[str, OptimizerBuilder] = {
    "adamw": _adamw,
    "adam": _adamw,  # Megatron-LM's name for AdamW (decoupled weight decay)
    "basis-rotation": _basis_rotation,  # Adam in a rotated eigenbasis for 2-D weights
}


def build_optimizer(args: argparse.Namespace, named: NamedParameters, stage: int,
                    shards: Shards | None = None) -> StageAdamW:
    """The stage's optimizer for ``--optimizer`` (validated at parse time against the registry)."""
    return OPTIMIZERS[args.optimizer](args, named, stage, shards)
