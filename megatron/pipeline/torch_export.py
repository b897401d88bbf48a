"""Building the order of a registered schedule for torch (``tools/export_schedule.py``,
``tools/plan_pipeline.py --export-csv``), and the torchtitan settings that run it.

The schedule is built as the trainer builds it from its flags (every schedule flag at its
default, ``--zb-costs`` if given), except that a schedule which would profile its costs first
(zb-1p, zb-2p by default) is ordered from the given costs or the placeholder ``T_F = T_B =
T_W = 1``: an exported CSV is one fixed order. Pure (no torch).
"""
from __future__ import annotations

from typing import Any

from megatron.pipeline.schedules import ScheduleConfig, ScheduleOptions, build_schedule, schedule_class
from megatron.pipeline.torch_actions import TorchOrder, order_from_schedule


def schedule_options(name: str, config: ScheduleConfig, flags: dict[str, Any] | None = None) -> ScheduleOptions:
    """``config.options`` of schedule ``name`` from its flags (by ``dest``; absent ones at their
    defaults), with profiling off (``zb_profile_iters = 0``) where the schedule takes that flag."""
    cls = schedule_class(name)
    values = {flag.dest: flag.default_value for group in cls.traits.flag_groups for flag in group.flags}
    values.update(flags or {})
    if "zb_profile_iters" in values:
        values["zb_profile_iters"] = 0
    return cls.traits.options_from_flags(values, config)


def export_order(name: str, num_stages: int, num_microbatches: int, num_chunks: int | None = None,
                 flags: dict[str, Any] | None = None, options: ScheduleOptions | None = None) -> TorchOrder:
    """One iteration of schedule ``name`` as torch's order (raises ScheduleConfigError or
    :class:`~megatron.pipeline.torch_actions.TorchOrderError`, one line). ``num_chunks``: model
    chunks per stage of a schedule that takes them (default 2); ``flags``: its flag values by
    ``dest`` (``{"zb_costs": "1,2,1,0"}``); ``options``: replace the options outright."""
    cls = schedule_class(name)
    chunks = (num_chunks or 2) if cls.traits.takes_model_chunks else 1
    base = ScheduleConfig(num_stages, num_microbatches, num_iterations=1, num_chunks=chunks)
    opts = schedule_options(name, base, flags) if options is None else options
    return order_from_schedule(build_schedule(name, ScheduleConfig(
        num_stages, num_microbatches, num_iterations=1, num_chunks=chunks, options=opts)))


def torchtitan_settings(order: TorchOrder, csv_path: str) -> str:
    """torchtitan's ``[parallelism]`` settings that run ``order`` from ``csv_path``. torchtitan runs a
    CSV with ``_PipelineScheduleRuntime`` and places stages by the named schedule class's style
    (``v`` for ZBVZeroBubble / DualPipeV, ``loop`` otherwise); the class's own order is replaced."""
    placed_by = "ZBVZeroBubble" if order.placement == "v" else "Interleaved1F1B"
    parts = order.num_ranks * order.stages_per_rank
    return (f"pipeline_parallel_degree = {order.num_ranks}; pipeline_parallel_schedule = \"{placed_by}\" "
            f"({'V' if order.placement == 'v' else 'loop'} placement, {order.stages_per_rank} stage(s) per rank; "
            f"the CSV replaces its order); pipeline_parallel_schedule_csv = \"{csv_path}\"; "
            f"pipeline_parallel_layers_per_stage = layers / {parts}; "
            f"pipeline_parallel_microbatch_size = local_batch_size / {order.num_microbatches} "
            f"({order.num_microbatches} micro-batches)")


def candidate_order(result: Any, data_parallel: int = 1) -> TorchOrder:
    """The order the planner simulated for a ranked synchronous candidate
    (:class:`~megatron.pipeline.planner.evaluate.CandidateResult`): its schedule ordered by the
    costs its flags run with (:func:`~megatron.pipeline.planner.evaluate.flag_order_costs`)."""
    from megatron.pipeline.planner.evaluate import flag_order_costs

    cand = result.candidate
    costs = flag_order_costs(cand, list(result.stage_costs), data_parallel)
    options = schedule_class(cand.schedule).traits.options(costs=costs)
    return order_from_schedule(build_schedule(cand.schedule, cand.config(1, options, data_parallel)))


def candidate_file_name(rank: int, cand: Any) -> str:
    return (f"{rank:02d}_{cand.schedule}_pp{cand.pipeline_model_parallel_size}_mbs{cand.micro_batch_size}"
            f"_m{cand.microbatches}_v{cand.virtual_stages}_{cand.recompute}_{cand.layer_split}.csv")
