"""Optimizer registry: ``--optimizer NAME`` looks the stage optimizer's builder up here.

Every builder gets the run's flags, the stage's named parameters, the stage index and the
ranges an AMDP replica owns, and returns an optimizer with the stage-local step interface of
:class:`~megatron.trainer.optim.adamw.StageAdamW` (step through ``p.data``, exact backups for
post-validation rollback). Adding an optimizer is one builder and one line here.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.optim.adamw import Shards, StageAdamW
from megatron.trainer.optim.basis_rotation import BasisRotationAdamW, RotationConfig
from megatron.trainer.optim.delay_nesterov import DelayNesterovAdamW, Lookahead
from megatron.trainer.optim.muon import MuonConfig, StageMuon, qkv_split_rows

NamedParameters = list[tuple[str, torch.nn.Parameter]]
OptimizerBuilder = Callable[[RunPlan, NamedParameters, int, "Shards | None"], StageAdamW]


def _hyperparameters(config: RunPlan) -> dict:
    optimizer = config.optimizer
    return dict(lr=optimizer.lr, weight_decay=optimizer.weight_decay, betas=(optimizer.adam_beta1, optimizer.adam_beta2),
                eps=optimizer.adam_eps)


def _adamw(config: RunPlan, named: NamedParameters, stage: int, shards: Shards | None) -> StageAdamW:
    return StageAdamW(named, exact=config.schedule.flag("optimizer_post_validation_exact"), shards=shards,
                      fused=config.optimizer.adam_kernel == "fused", **_hyperparameters(config))


def _basis_rotation(config: RunPlan, named: NamedParameters, stage: int,
                    shards: Shards | None) -> StageAdamW:
    """Gets the stage index and the pipeline depth: the stage-aware refresh budget depends on them."""
    optimizer = config.optimizer
    rotation = RotationConfig(
        geometry=optimizer.rotation_geometry, source=optimizer.rotation_source,
        refresh_interval=optimizer.rotation_refresh_interval, stage_aware=optimizer.rotation_stage_aware,
        stage=stage, num_stages=config.parallel.pipeline_model_parallel_size)
    return BasisRotationAdamW(named, rotation=rotation, **_hyperparameters(config))


def _muon(config: RunPlan, named: NamedParameters, stage: int, shards: Shards | None) -> StageAdamW:
    """Muon for 2-D hidden weights, AdamW (the same hyper-parameters) for the rest; the QKV split
    comes from the model's heads and query groups."""
    optimizer, model = config.optimizer, config.model
    split = qkv_split_rows(model.num_attention_heads, model.num_query_groups, model.kv_channels,
                           model.hidden_size) if optimizer.muon_split_qkv else None
    muon = MuonConfig(momentum=optimizer.muon_momentum, use_nesterov=optimizer.muon_use_nesterov,
                      num_ns_steps=optimizer.muon_num_ns_steps, scale_mode=optimizer.muon_scale_mode,
                      extra_scale_factor=optimizer.muon_extra_scale_factor, ns_dtype=optimizer.muon_ns_dtype,
                      qkv_split=split)
    return StageMuon(named, exact=config.schedule.flag("optimizer_post_validation_exact"), muon=muon,
                     **_hyperparameters(config))


def _delay_nesterov(config: RunPlan, named: NamedParameters, stage: int, shards: Shards | None) -> StageAdamW:
    """NAdam with the look-ahead of the stage's declared gradient delay (the schedule policy's)."""
    run = config.run
    delays = run.schedule_cls.traits.policy_for(run.schedule).gradient_delays
    if delays is None:
        raise ValueError(f"--optimizer delay-nesterov: {config.schedule.pipeline_schedule} declares no gradient delay")
    optimizer = config.optimizer
    lookahead = Lookahead(delay=delays[stage], num_stages=len(delays), max_momentum=optimizer.lookahead_max_momentum,
                          momentum_decay=optimizer.nadam_momentum_decay)
    return DelayNesterovAdamW(named, lookahead=lookahead, shards=shards, **_hyperparameters(config))


OPTIMIZERS: dict[str, OptimizerBuilder] = {
    "adamw": _adamw,
    "adam": _adamw,  # Megatron-LM's name for AdamW (decoupled weight decay)
    "basis-rotation": _basis_rotation,  # Adam in a rotated eigenbasis for 2-D weights
    "muon": _muon,  # orthogonalised momentum for 2-D hidden weights, AdamW for the rest
    "delay-nesterov": _delay_nesterov,  # NAdam whose look-ahead grows with the stage's gradient delay
}


#: Optimizers that adapt to a gradient delay the schedule declares (``SchedulePolicy.gradient_delays``):
#: refused with synchronous schedules.
DELAY_AWARE = frozenset({"delay-nesterov"})


def takes_schedule(optimizer: str, asynchronous: bool) -> bool:
    """Whether ``optimizer`` runs under a schedule that is (or is not) asynchronous."""
    return asynchronous or optimizer not in DELAY_AWARE


def build_optimizer(config: RunPlan, named: NamedParameters, stage: int,
                    shards: Shards | None = None) -> StageAdamW:
    """The stage's optimizer for ``--optimizer`` (checked at parse time against the registry)."""
    return OPTIMIZERS[config.optimizer.optimizer](config, named, stage, shards)
