"""Each rank's peak memory, estimated from the flags alone (before any rank starts).

Why: a run that cannot fit used to die inside a rank with an allocator traceback
(``--hidden-size 1048576`` asked the host for 4.4 TB in its first layer), after the launch, the
rendezvous and the model build. :mod:`megatron.trainer.launch.memory_check` compares this
estimate with what the host or the GPU has; the run banner prints it for every run; the GPU
check (``benchmarks/gpu_check.py``) can call :func:`estimate_memory` with the same ``args``.

One job: add up what a rank holds at its peak, from the project's existing accounting, per
pipeline stage (a rank is one stage of one data-parallel, tensor-parallel replica):

* **weights, gradients, optimizer state**: the planner's static model
  (:func:`megatron.pipeline.costs.memory.stage_memory`, one source for both) over the analytic
  parameter counts of :mod:`megatron.pipeline.costs.cost_model` for the stage's model parts, divided by the tensor-parallel
  size; weights ``param_bytes`` each (2 in bf16/fp16) times the schedule's weight copies
  (``SchedulePolicy.weight_copies``: 2BW's stash, PipeMare's delta), gradients ``param_bytes`` each,
  AdamW's two fp32 moments plus an fp32 master in bf16/fp16, divided over the data-parallel
  replicas with ``--use-distributed-optimizer`` (ZeRO-1) and over AMDP's replicas when the
  schedule shards the state;
* **activations**: the cost model's per-micro-batch activation bytes of the stage's layers (its
  embedding output and, on the last part, the logits and their softmax), scaled by the
  recompute fraction of :mod:`megatron.pipeline.costs.activation_memory`, times the schedule's peak
  micro-batches in flight on the stage (the timing simulator,
  :func:`~megatron.trainer.tasks.balanced_partition.schedule_in_flight`; one op of an
  interleaved schedule holds one chunk's share); plus the backward's working set, one layer's
  activations;
* **LM-head logits** (last stage): the loss backward's fp32 logits gradient and the copy cast
  to the parameters' dtype, ``micro_batch * seq * vocab * 4`` bytes each, live at once during
  the head's backward (the held logits and softmax are in the activations above);
* **baseline**: the process before its model exists (torch, megatron-core, the launcher's own
  state): measured by the caller (:func:`current_rss_bytes` on CPU, where forked ranks inherit
  the launcher's pages); 0 on a GPU, whose free memory is read directly.

Host heap factor (CPU only). The cost model counts the tensors autograd saves in an ideal layer
(``16h + 2as`` elements per token). A CPU rank's resident memory per in-flight micro-batch is
larger: the activation meter sees 1.3x (dropout masks, the math-path attention's probabilities),
and glibc keeps the forward's freed temporaries between the saved tensors. Measured peak RSS
growth per in-flight micro-batch over the cost model's bytes (fp32, dropout 0.1, this repo's
local layer spec, 2 CPU cores; ``GPipe`` m = 2 -> 4 in the emulator and 1F1B m = 1 -> 4 in the
distributed runtime): h 256 s 128: 1.68; h 256 s 256: 1.68; h 512 s 128: 1.87; rank 0 of PP 2
h 512 s 256 a 8: 1.64 (m = 1) and 2.09 (m = 4). :data:`HOST_HEAP_FACTOR` is their middle,
1.8 (within 16 % of every run). On a GPU the factor is 1 (the caching allocator reuses blocks;
not measured here: no GPU on the machine this was written on).
"""
from __future__ import annotations


from megatron.pipeline.costs.activation_memory import LayerShape, recompute_fraction
from megatron.pipeline.costs.cost_model import ModelShape, layer_activation_elements
from megatron.pipeline.costs.memory import MemoryEstimate, RankMemory, stage_memory
from megatron.pipeline.costs.stages import part_activation_bytes, part_parameters
from megatron.trainer.config.run_plan import RunPlan

#: CPU: peak RSS per in-flight micro-batch / the cost model's activation bytes (module docstring)
HOST_HEAP_FACTOR = 1.8
GIB = 2 ** 30


def model_shape(config: RunPlan) -> ModelShape:
    """The cost model's view of the flags (the balanced split's, so both count the same model)."""
    from megatron.trainer.tasks.balanced_partition import model_shape as partition_shape

    shape = partition_shape(config)
    if shape is None:  # a task without transformer layers (the synthetic benchmark): nothing to count
        raise ValueError("this task has no transformer layers to estimate")
    return shape


def part_layer_counts(config: RunPlan, parts: int) -> list[int]:
    """Layers of each consecutive model part (the split the stage builder uses)."""
    split = config.layers.counts
    if split is not None and len(split) == parts:
        return [int(c) for c in split]
    base, extra = divmod(config.model.num_layers, parts)
    return [base + (1 if p < extra else 0) for p in range(parts)]


def _recompute_kept(config: RunPlan, shape: ModelShape, layers: int) -> float:
    granularity = config.recompute.recompute_granularity
    if granularity is None or layers == 0:
        return 1.0
    layer_shape = LayerShape(shape.seq_length, shape.micro_batch, shape.hidden, shape.heads)
    return recompute_fraction(layer_shape, layers, granularity, config.recompute.recompute_method,
                              config.recompute.recompute_num_layers)


def _optimizer_shards(config: RunPlan, run_shards: bool, chunks: int) -> int:
    dp = config.parallel.data_parallel_size if config.parallel.use_distributed_optimizer else 1
    return dp * (chunks if run_shards else 1)


def estimate_memory(config: RunPlan, baseline_bytes: float = 0.0, device: str = "cpu") -> MemoryEstimate:
    """Every stage's per-rank peak bytes for validated ``args`` (``parse_args``'s namespace);
    ``baseline_bytes`` is added to each rank (see the module docstring)."""
    from megatron.pipeline.schedules import schedule_class
    from megatron.trainer.tasks.balanced_partition import schedule_in_flight

    shape, run = model_shape(config), config.run
    layout, tp = run.layout, max(1, config.parallel.tensor_model_parallel_size)
    parts = layout.num_model_stages
    counts = part_layer_counts(config, parts)
    in_flight = schedule_in_flight(config)
    factor = HOST_HEAP_FACTOR if device == "cpu" else 1.0
    tokens = shape.seq_length * shape.micro_batch
    weight_copies = schedule_class(config.schedule.pipeline_schedule).traits.policy_for(run.schedule).weight_copies
    stages = []
    for stage in range(layout.num_stages):
        held = [layout.model_stage(stage, c) for c in range(layout.num_chunks)]
        params = sum(part_parameters(shape, counts[p], p == 0, p == parts - 1) for p in held) / tp
        per_mb = sum(part_activation_bytes(shape, counts[p], p == 0, p == parts - 1,
                                           _recompute_kept(config, shape, counts[p])) for p in held) / tp
        has_layers = any(counts[p] for p in held)
        working = layer_activation_elements(shape) * shape.activation_bytes / tp if has_layers else 0.0
        copies = weight_copies[stage]
        shards = _optimizer_shards(config, run.shards_optimizer_state, layout.num_chunks)
        last = (parts - 1) in held
        one = factor * per_mb / layout.num_chunks
        static = stage_memory(params, shape.param_bytes, copies - 1, shards, 0.0, 0.0)  # the planner's model
        stages.append(RankMemory(
            stage=stage, parameters=int(params),
            weights=static.weights, gradients=static.gradients, optimizer=static.optimizer,
            activations=in_flight[stage] * one + factor * working,
            logits=tokens * shape.vocab * (4 + shape.param_bytes) / tp if last else 0.0,
            baseline=baseline_bytes, in_flight=in_flight[stage], per_microbatch=one))
    return MemoryEstimate(tuple(stages), device)


def current_rss_bytes() -> float:
    """This process's resident memory now (``VmRSS``); 0 where ``/proc`` has none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 0.0



def memory_banner_line(config: RunPlan) -> str | None:
    """The banner's estimate: the one the memory check used (``plan.memory.estimate``), else made
    now (a run started without ``preflight``, or the GPU launcher's ranks); None for a task without
    transformer layers."""
    estimate = config.memory.estimate if config.memory is not None else None
    if estimate is None:
        try:
            model_shape(config)
        except (ValueError, AttributeError):
            return None
        import torch

        gpu = config.launch.device == "cuda" or (config.launch.device == "auto" and torch.cuda.is_available())
        estimate = estimate_memory(config, 0.0 if gpu else current_rss_bytes(), "cuda" if gpu else "cpu")
    return estimate.banner_line()
