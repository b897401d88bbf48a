"""zb-v's placeholder costs per V chunk when the layer split makes the chunks differ.

Why: without ``--zb-costs`` or profiling, zb-v orders its ops for ``T_F = T_B = T_W = 1`` on
every chunk. On the even split that is nearly right; on the balanced split of a V
(:mod:`megatron.pipeline.costs.chunk_partition`) the chunk beside the head holds fewer layers
and the head, and the others more, so one cost for all chunks misplaces the order's fills. The
placeholder becomes per chunk, scaled by each chunk's analytic FLOPs over the mean chunk's
(:mod:`megatron.pipeline.costs.cost_model`), the same model that chose the split: decided from
the flags alone, so the emulator and every rank plan the same order.
"""
from __future__ import annotations

import argparse
import dataclasses

from megatron.pipeline.costs.cost_model import layer_units
from megatron.pipeline.costs.op_costs import OpCosts
from megatron.pipeline.ir import VShapeLayout
from megatron.pipeline.schedules import ScheduleConfig, schedule_class
from megatron.pipeline.schedules.zero_bubble.flags import ZeroBubbleOptions


def chunk_flops(args: argparse.Namespace, counts: list[int]) -> list[float] | None:
    """Analytic forward + backward FLOPs of each model part of ``counts`` layers (None: no model to count)."""
    from megatron.trainer.config.job_config import build_job_config
    from megatron.trainer.tasks.balanced_partition import model_shape

    shape = model_shape(build_job_config(args))
    if shape is None:
        return None
    layer, first, last = layer_units(shape)
    end = len(counts) - 1
    return [n * layer.time + (first.time if j == 0 else 0.0) + (last.time if j == end else 0.0)
            for j, n in enumerate(counts)]


def with_chunk_costs(args: argparse.Namespace, config: ScheduleConfig, split: list[int] | None) -> ScheduleConfig:
    """``config`` with per-chunk placeholder costs where a planned V schedule would plan from its
    one placeholder and the run's layer ``split`` gives every V chunk its own count; else ``config``."""
    options = config.options
    if split is None or not isinstance(options, ZeroBubbleOptions) or options.profile_iters:
        return config
    if not isinstance(options.costs, OpCosts):  # --zb-costs: the user's
        return config
    layout = schedule_class(args.pipeline_schedule).traits.layout_of(config)
    if not isinstance(layout, VShapeLayout) or len(split) != layout.num_model_stages:
        return config
    flops = chunk_flops(args, [int(c) for c in split])
    if flops is None:
        return config
    mean, base = sum(flops) / len(flops), options.costs
    costs = tuple(dataclasses.replace(base, t_f=base.t_f * f / mean, t_b=base.t_b * f / mean, t_w=base.t_w * f / mean)
                  for f in flops)
    return dataclasses.replace(config, options=dataclasses.replace(options, costs=costs))
