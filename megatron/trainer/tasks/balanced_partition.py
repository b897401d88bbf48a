"""``--pipeline-partition balanced`` (the default): the layer split from the analytic cost model.

Why here and torch-free: the split is decided while the flags are validated, before any rank
starts, from the flags alone (:mod:`megatron.pipeline.costs.cost_model`), so every rank, the
emulator and a resumed run compute the same split without communicating, and the checkpoint's
run signature (``pipeline_layer_split``) records it. The solver is PACI's min-max partition
(:mod:`megatron.pipeline.costs.partition`); the memory budget is ``--pipeline-partition-memory-gb``
only (the device's memory would make the split depend on the machine).

When it applies: a GPT or BERT on one chain of model parts (one per stage, or chunks: a V's two
per stage, interleaving's V per stage; not AMDP's replicated pipelines), no explicit
``--pipeline-layer-split``, no full recompute (its units need the split up front), more than
one stage. Otherwise the default is the even split; asking for ``balanced`` explicitly there is
refused. For chunked layouts the split is per model part and evens out every *rank's* total
(:mod:`megatron.pipeline.costs.chunk_partition`): a V's rank 0 holds both the embedding and the
head, so it takes fewer layers.
"""
from __future__ import annotations

import dataclasses
import math

from megatron.pipeline.costs.chunk_partition import ChunkPartition, partition_chunks
from megatron.pipeline.costs.cost_model import ModelShape, layer_costs, layer_units
from megatron.pipeline.costs.partition import Partition, one_f_one_b_in_flight, partition_layers
from megatron.pipeline.costs.stages import hosts_replicas
from megatron.pipeline.ir import PipelineLayout
from megatron.trainer.config.job_config import JobConfig
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.tokenizer.vocabulary import vocabulary


def model_shape(config: JobConfig) -> ModelShape | None:
    """The cost model's view of the flags; None for a task without transformer layers."""
    if config.task.model_family == "synthetic":  # the synthetic-cost benchmark: sleeps, no layers
        return None
    h, heads = config.model.hidden_size, config.model.num_attention_heads
    half = bool(config.precision.bf16 or config.precision.fp16)
    learned = config.model.position_embedding_type == "learned_absolute"
    bert = config.task.model_family == "bert"
    return ModelShape(
        num_layers=config.model.num_layers, hidden=h, ffn=config.model.ffn_hidden_size or 4 * h, heads=heads,
        query_groups=config.model.num_query_groups or heads,
        kv_channels=config.model.kv_channels or h // heads, seq_length=config.model.seq_length,
        micro_batch=config.training.micro_batch_size, vocab=vocabulary(config).size,
        gated_mlp=bool(config.model.swiglu), bert=bert,
        binary_head=bert and bool(config.task.bert_binary_head),  # type: ignore[attr-defined]
        position_table=(config.model.max_position_embeddings or config.model.seq_length) if learned else 0,
        param_bytes=2 if half else 4, activation_bytes=2 if half else 4)


def run_layout(config: RunPlan) -> PipelineLayout:
    """The placement of the run's schedule: which model parts each stage hosts."""
    from megatron.pipeline.schedules import schedule_class
    from megatron.trainer.config.job_config import job_schedule_config

    schedule_cls = schedule_class(config.schedule.pipeline_schedule)
    return schedule_cls.traits.layout_of(job_schedule_config(config))


def why_not_balanced(config: RunPlan) -> str | None:
    """Why the balanced split cannot apply to this run (None: it can)."""
    model, parallel = config.model, config.parallel
    if parallel.pipeline_model_parallel_size < 2:
        return "one stage has nothing to balance"
    if model_shape(config) is None:
        return "this task has no transformer layers to count"
    if model.num_layers < parallel.pipeline_model_parallel_size:
        return f"--num-layers {model.num_layers} < --pipeline-model-parallel-size {parallel.pipeline_model_parallel_size}"
    if config.recompute.recompute_granularity == "full":
        return "--recompute-granularity full needs the even split"
    layout = run_layout(config)
    if hosts_replicas(layout):
        return f"--pipeline-schedule {config.schedule.pipeline_schedule} places replicated pipelines (even split)"
    if model.num_layers < layout.num_model_stages:
        return f"--num-layers {model.num_layers} < the {layout.num_model_stages} model chunks of the layout"
    return None


def schedule_in_flight(config: RunPlan) -> list[float]:
    """Peak micro-batches whose activations each stage holds under the run's schedule: the
    timing simulator's peak with unit op costs (1F1B and PACI: ``N - s``; GPipe: ``m``)."""
    from megatron.pipeline.schedules import build_schedule
    from megatron.pipeline.simulator import simulate_schedule
    from megatron.trainer.config.job_config import job_schedule_config

    pp, m = config.parallel.pipeline_model_parallel_size, config.num_microbatches
    try:
        iterations = min(config.training.train_iters, 3)
        first = dataclasses.replace(job_schedule_config(config), first_iteration=0, num_iterations=iterations)
        result = simulate_schedule(build_schedule(config.schedule.pipeline_schedule, first))
        peaks = [max(1.0, p) for p in result.peak_memory]
        if len(peaks) == pp:
            return peaks
    except Exception:  # noqa: BLE001 - a schedule the simulator cannot run without profiling: 1F1B's counts
        pass
    return [float(w) for w in one_f_one_b_in_flight(pp, m)]


def balanced_partition(config: RunPlan) -> Partition | ChunkPartition:
    """The min-max split of the analytic costs (memory-constrained with the flag): per stage for
    one part per stage (PACI's chain solver over per-layer costs), per model part balancing the
    ranks' totals for a chunked layout (V, interleaved)."""
    shape = model_shape(config)
    assert shape is not None
    budget = budget_bytes(config)
    pp = config.parallel.pipeline_model_parallel_size
    # no budget, no constraint: the in-flight counts (a simulation) only matter against one
    in_flight = [1.0] * pp if math.isinf(budget) else schedule_in_flight(config)
    layout = run_layout(config)
    if layout.num_model_stages == layout.num_stages:
        costs = layer_costs(shape)
        return partition_layers(costs.time, costs.static, costs.activation, in_flight, budget)
    owners = [layout.physical(v)[0] for v in range(layout.num_model_stages)]
    return partition_chunks(shape.num_layers, owners, *layer_units(shape), in_flight, budget)


def even_counts(num_layers: int, num_stages: int) -> list[int]:
    return [num_layers // num_stages] * num_stages


def balanced_split(config: RunPlan) -> tuple[list[int] | None, bool]:
    """(the balanced split, per stage, or per model part for a chunked layout; None where it is
    the even one, so runs whose split did not change keep their signature; whether it fits the
    memory budget)."""
    partition = balanced_partition(config)
    counts = list(partition.counts)
    even = counts == even_counts(config.model.num_layers, len(counts))
    return (None if even else counts), partition.feasible


def checkpoint_split(config: RunPlan) -> tuple[bool, list[int] | None]:
    """(whether ``--load`` has a checkpoint to resume, the layer split it was saved with: None
    for the even split). A resumed run keeps its weights' split: profiling again could choose
    another one, and a checkpoint saved before the balanced default has the even split."""
    if config.checkpoint.load is None:
        return False, None
    from megatron.trainer.checkpointing.checkpoint import CheckpointError, _read_metadata, find_resume_point

    try:
        point = find_resume_point(config.checkpoint.load)
        if point is None:
            return False, None
        signature = _read_metadata(point.directory)["signature"]
        split = signature.get("pipeline_layer_split")
        same_cut = (signature.get("pipeline_model_parallel_size") == config.parallel.pipeline_model_parallel_size
                    and signature.get("num_layers") == config.model.num_layers
                    and _saved_layout(signature) == run_layout(config))
    except (CheckpointError, KeyError, TypeError, AttributeError):
        return False, None  # check_resume reports a broken checkpoint with its own message
    if not same_cut:  # another stage count, depth or placement: nothing to keep (resharding moves the weights)
        return False, None
    return True, ([int(c) for c in split] if split else None)


def _saved_layout(signature: dict) -> PipelineLayout:
    """The placement a checkpoint was saved in (one part per stage for a signature without a schedule)."""
    from megatron.trainer.checkpointing.reshard import schedule_policy

    policy = schedule_policy(signature)
    return policy.layout if policy is not None else PipelineLayout(int(signature["pipeline_model_parallel_size"]))


def rank_layers(layout: PipelineLayout, part_counts: list[int]) -> list[int]:
    """Layers each stage holds, over all of its model parts."""
    out = [0] * layout.num_stages
    for part, count in enumerate(part_counts):
        out[layout.physical(part)[0]] += count
    return out


def layer_split_line(config: RunPlan) -> str:
    """One banner line: how the layers are split over the stages, and why."""
    pp = config.parallel.pipeline_model_parallel_size
    layers = config.layers
    counts = list(layers.counts) if layers.counts is not None else None
    if counts is None and config.num_model_chunks == 1 and config.model.num_layers % pp == 0:
        counts = even_counts(config.model.num_layers, pp)
    how = {"explicit": layers.source or "--pipeline-layer-split",
           "checkpoint": "the --load checkpoint's"}.get(layers.partition, f"--pipeline-partition {layers.partition}")
    if counts is None and layers.source:  # an even virtual layout
        how = layers.source
    if counts is not None and len(counts) != pp:  # per model chunk: say what every rank holds too
        layout = run_layout(config)
        line = (f"layer split: {counts} per model chunk, {rank_layers(layout, counts)} per rank "
                f"(rank of each chunk: {[layout.physical(v)[0] for v in range(len(counts))]}) ({how})")
    else:
        line = f"layer split: {counts if counts is not None else 'even over the model chunks'} ({how})"
    if not layers.feasible:
        line += " WARNING: no split fits --pipeline-partition-memory-gb; least overshoot"
    return line


def budget_bytes(config: RunPlan) -> float:
    """``--pipeline-partition-memory-gb`` in bytes (unlimited without it)."""
    gb = config.parallel.pipeline_partition_memory_gb
    return math.inf if gb is None else gb * 2**30
