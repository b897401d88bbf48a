"""``--pipeline-partition balanced`` (the default): the layer split from the analytic cost model.

Why here and torch-free: the split is decided while the flags are validated, before any rank
starts, from the flags alone (:mod:`megatron.pipeline.cost_model`), so every rank, the
emulator and a resumed run compute the same split without communicating, and the checkpoint's
run signature (``pipeline_layer_split``) records it. The solver is PACI's min-max partition
(:mod:`megatron.pipeline.partition`); the memory budget is ``--pipeline-partition-memory-gb``
only (the device's memory would make the split depend on the machine).

When it applies: a GPT or BERT whose stages each hold one consecutive part of the model (not
interleaved chunks, not AMDP's replicated pipelines), no explicit ``--pipeline-layer-split``,
no full recompute (its units need the split up front), more than one stage. Otherwise the
default is the even split; asking for ``balanced`` explicitly there is refused.
"""
from __future__ import annotations

import argparse
import dataclasses
import math

from megatron.pipeline.cost_model import ModelShape, layer_costs
from megatron.pipeline.partition import Partition, one_f_one_b_in_flight, partition_layers


def model_shape(args: argparse.Namespace) -> ModelShape | None:
    """The cost model's view of the flags; None for a task without transformer layers."""
    if hasattr(args, "synthetic_forward_ms"):  # the synthetic-cost benchmark: sleeps, no layers
        return None
    h, heads = args.hidden_size, args.num_attention_heads
    half = bool(args.bf16 or args.fp16)
    learned = args.position_embedding_type == "learned_absolute"
    bert = hasattr(args, "bert_binary_head")
    return ModelShape(
        num_layers=args.num_layers, hidden=h, ffn=args.ffn_hidden_size or 4 * h, heads=heads,
        query_groups=args.num_query_groups or heads,
        kv_channels=args.kv_channels or h // heads, seq_length=args.seq_length,
        micro_batch=args.micro_batch_size, vocab=args.vocab_size,
        gated_mlp=bool(args.swiglu), bert=bert,
        binary_head=bert and bool(args.bert_binary_head),
        position_table=(args.max_position_embeddings or args.seq_length) if learned else 0,
        param_bytes=2 if half else 4, activation_bytes=2 if half else 4)


def one_part_per_stage(args: argparse.Namespace) -> bool:
    """Whether each stage holds exactly one consecutive part of the model (the split's premise)."""
    if args.num_model_chunks != 1:
        return False
    from megatron.pipeline.schedules import schedule_class
    from megatron.trainer.config.run_config import schedule_config

    config = schedule_config(args)
    return schedule_class(args.pipeline_schedule).layout_of(config).num_chunks == 1


def why_not_balanced(args: argparse.Namespace) -> str | None:
    """Why the balanced split cannot apply to this run (None: it can)."""
    if args.pipeline_model_parallel_size < 2:
        return "one stage has nothing to balance"
    if model_shape(args) is None:
        return "this task has no transformer layers to count"
    if args.num_layers < args.pipeline_model_parallel_size:
        return f"--num-layers {args.num_layers} < --pipeline-model-parallel-size {args.pipeline_model_parallel_size}"
    if args.recompute_granularity == "full":
        return "--recompute-granularity full needs the even split"
    if not one_part_per_stage(args):
        return f"--pipeline-schedule {args.pipeline_schedule} places several model chunks per stage (even split)"
    return None


def schedule_in_flight(args: argparse.Namespace) -> list[float]:
    """Peak micro-batches whose activations each stage holds under the run's schedule: the
    timing simulator's peak with unit op costs (1F1B and PACI: ``N - s``; GPipe: ``m``)."""
    from megatron.pipeline.schedules import build_schedule
    from megatron.pipeline.simulator import simulate_schedule
    from megatron.trainer.config.run_config import schedule_config

    pp, m = args.pipeline_model_parallel_size, args.num_microbatches
    try:
        iterations = min(args.train_iters, 3)
        config = dataclasses.replace(schedule_config(args), first_iteration=0, num_iterations=iterations)
        result = simulate_schedule(build_schedule(args.pipeline_schedule, config))
        peaks = [max(1.0, p) for p in result.peak_memory]
        if len(peaks) == pp:
            return peaks
    except Exception:  # noqa: BLE001 - a schedule the simulator cannot run without profiling: 1F1B's counts
        pass
    return [float(w) for w in one_f_one_b_in_flight(pp, m)]


def balanced_partition(args: argparse.Namespace) -> Partition:
    """The min-max split of the analytic per-layer costs (memory-constrained with the flag)."""
    shape = model_shape(args)
    assert shape is not None
    costs = layer_costs(shape)
    budget = budget_bytes(args)
    # no budget, no constraint: the in-flight counts (a simulation) only matter against one
    in_flight = [1.0] * args.pipeline_model_parallel_size if math.isinf(budget) else schedule_in_flight(args)
    return partition_layers(costs.time, costs.static, costs.activation, in_flight, budget)


def even_counts(num_layers: int, num_stages: int) -> list[int]:
    return [num_layers // num_stages] * num_stages


def apply_balanced_split(args: argparse.Namespace) -> None:
    """Set ``args.pipeline_layer_split`` to the balanced split when it differs from the even one
    (an even split stays ``None``, so runs whose split did not change keep their signature)."""
    partition = balanced_partition(args)
    counts = list(partition.counts)
    if counts != even_counts(args.num_layers, args.pipeline_model_parallel_size):
        args.pipeline_layer_split = counts
        args._balanced_split = True  # not the user's: a second validation decides it again
    args.pipeline_partition_feasible = partition.feasible


def checkpoint_split(args: argparse.Namespace) -> tuple[bool, list[int] | None]:
    """(whether ``--load`` has a checkpoint to resume, the layer split it was saved with: None
    for the even split). A resumed run keeps its weights' split: profiling again could choose
    another one, and a checkpoint saved before the balanced default has the even split."""
    if args.load is None:
        return False, None
    from megatron.trainer.checkpointing.checkpoint import CheckpointError, _read_metadata, find_resume_point

    try:
        point = find_resume_point(args.load)
        if point is None:
            return False, None
        signature = _read_metadata(point.directory)["signature"]
        split = signature.get("pipeline_layer_split")
        same_cut = (signature.get("pipeline_model_parallel_size") == args.pipeline_model_parallel_size
                    and signature.get("num_layers") == args.num_layers)
    except (CheckpointError, KeyError, TypeError, AttributeError):
        return False, None  # check_resume reports a broken checkpoint with its own message
    if not same_cut:  # another stage count or depth: nothing to keep (check_resume says what differs)
        return False, None
    return True, ([int(c) for c in split] if split else None)


def layer_split_line(args: argparse.Namespace) -> str:
    """One banner line: how the layers are split over the stages, and why."""
    pp = args.pipeline_model_parallel_size
    split = args.pipeline_layer_split
    counts = list(split) if split is not None else None
    if counts is None and args.num_model_chunks == 1 and args.num_layers % pp == 0:
        counts = even_counts(args.num_layers, pp)
    mode = args.pipeline_partition
    how = {"explicit": args.layer_split_source or "--pipeline-layer-split",
           "checkpoint": "the --load checkpoint's"}.get(mode, f"--pipeline-partition {mode}")
    if counts is None and args.layer_split_source:  # an even virtual layout
        how = args.layer_split_source
    line = f"layer split: {counts if counts is not None else 'even over the model chunks'} ({how})"
    if args.pipeline_partition_feasible is False:
        line += " WARNING: no split fits --pipeline-partition-memory-gb; least overshoot"
    return line


def budget_bytes(args: argparse.Namespace) -> float:
    """``--pipeline-partition-memory-gb`` in bytes (unlimited without it)."""
    gb = args.pipeline_partition_memory_gb
    return math.inf if gb is None else gb * 2**30
