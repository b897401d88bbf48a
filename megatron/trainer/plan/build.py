"""The run plan, built once from the checked flags (:class:`~megatron.trainer.config.run_plan.RunPlan`).

The flags are parsed and checked first (:mod:`megatron.trainer.plan.parse`); this derives what
the run reads besides them: the layer split (:mod:`.partition`), the schedule's config and the
stage layout (with zb-v's per-chunk placeholder costs where the split gives its V chunks
different sizes), the batch of every iteration, the model's vocabulary and whether it ties its
embeddings. The launch's checks then add the memory estimate
(:mod:`megatron.trainer.launch.memory_check`) and ``auto`` its layouts
(:mod:`megatron.trainer.loop.auto`), each as a new plan.
"""
from __future__ import annotations

import argparse

from megatron.trainer.config.job_config import build_job_config
from megatron.trainer.config.rampup_args import batch_plan
from megatron.trainer.config.run_plan import LayerSplit, RunPlan
from megatron.trainer.config.tied_args import embeddings_of
from megatron.trainer.plan.partition import planned_run, resolve_partition
from megatron.trainer.tokenizer.vocabulary import vocabulary


def build_run_plan(args: argparse.Namespace, layers: LayerSplit | None = None) -> RunPlan:
    """The plan of the checked flags ``args`` (``layers``: the split the checks decided, else
    decided again: the same, from the same flags and checkpoint)."""
    config = build_job_config(args)
    layers = resolve_partition(args) if layers is None else layers
    return RunPlan(config, planned_run(args, layers.counts), batch_plan(args), layers, vocabulary(config),
                   embeddings_of(config))
