"""``--pipeline-partition profiled`` (alias ``auto``): profile a GPT's or BERT's parts on this
device, then split its layers with PACI's memory-constrained min-max partition
(:mod:`megatron.pipeline.costs.partition`).

Why profile only three parts: the transformer layers of a GPT are identical, so one layer's
forward+backward time, static memory and activation memory stand for all of them; only the
first stage's embedding and the last stage's final norm, output head and loss differ. They are
measured as differences: (embedding + layer) - layer and (layer + head) - layer, each a
megatron-core stage built exactly as the trainer builds it, so whatever the stage wrapper
adds is counted where it runs.

* time: median of ``--pipeline-partition-profile-iters`` forward+backward passes of one
  micro-batch after one warm-up pass (device synchronised around each on CUDA). PACI times
  the forward only, arguing backward is proportional; we time both, which costs little.
* static memory: parameters and gradients in the parameter dtype, AdamW's two moments in
  fp32, plus an fp32 master copy for bf16/fp16 parameters (``megatron/trainer/optim/adamw.py``).
* activation memory: the bytes autograd saves for backward in one forward (the runtime's own
  :class:`~megatron.pipeline.runtime.memory.ActivationMeter`, parameters excluded).
* in-flight micro-batches per stage: the timing simulator's peak activation count of the
  run's schedule (1F1B and PACI: ``N - s``; GPipe: ``m``), with unit op costs.

Every rank must use the same split: under torch.distributed rank 0 profiles and broadcasts it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megatron.pipeline.runtime.memory import ActivationMeter
from megatron.pipeline.costs.chunk_partition import ChunkPartition, Unit, partition_chunks
from megatron.pipeline.costs.partition import Partition, partition_layers
from megatron.pipeline.ir import PipelineLayout
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.tasks.balanced_partition import schedule_in_flight
from megatron.trainer.tasks.task import PretrainTask

_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class PartProfile:
    """One profiled part: forward+backward time (ms) and memory (bytes)."""

    time_ms: float
    static_bytes: float
    activation_bytes: float

    def minus(self, other: "PartProfile") -> "PartProfile":
        """This part without ``other`` (clamped at 0: timing noise must not make a part negative)."""
        return PartProfile(max(0.0, self.time_ms - other.time_ms), max(0.0, self.static_bytes - other.static_bytes),
                           max(0.0, self.activation_bytes - other.activation_bytes))


def static_bytes(module: torch.nn.Module) -> float:
    """Parameters + gradients + AdamW moments (fp32) + fp32 masters for half-precision parameters."""
    total = 0
    for p in module.parameters():
        master = 4 if p.dtype in _HALF else 0
        total += p.numel() * (2 * p.element_size() + 8 + master)
    return float(total)


@contextlib.contextmanager
def _synchronised(device: torch.device) -> Iterator[None]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_part(chunk: torch.nn.Module, task: PretrainTask, config: RunPlan, device: torch.device,
                 first: bool, last: bool, iters: int) -> PartProfile:
    """Time and memory of one stage-shaped part on one micro-batch (see the module docstring)."""
    batch = task.batch_fn(config, 0, device)(0)
    shape, dtype = task.activation_spec(config)
    x = None if first else torch.randn(shape, device=device).to(dtype).requires_grad_(True)
    meter = ActivationMeter(chunk.parameters())

    def forward_backward(key: int) -> None:
        with meter.record(key):
            out = chunk(x, batch)
            if last:
                out, _ = task.loss_fn(out, batch)
        if last:
            out.backward()
        else:
            out.backward(torch.ones_like(out))
        meter.release(key)

    times = []
    for i in range(iters + 1):
        with _synchronised(device):
            start = time.perf_counter()
            forward_backward(i)
            elapsed = time.perf_counter() - start
        if i:  # the first pass warms up (allocations, lazy initialisation)
            times.append(1e3 * elapsed)
    chunk.zero_grad(set_to_none=True)
    return PartProfile(statistics.median(times), static_bytes(chunk), float(meter.run_peak_bytes))


def profile_parts(task: PretrainTask, config: RunPlan, device: torch.device) -> dict[str, PartProfile]:
    """Per-part profiles: ``layer`` (one transformer layer), ``embedding``, ``head`` (norm, output
    heads, loss)."""
    builder = task.part_builder()
    if builder is None:
        raise ValueError(f"task {task.name} builds no parts to profile")
    model_args_of, build_stage = builder
    model_args = model_args_of(config)
    iters = config.parallel.pipeline_partition_profile_iters
    one = range(0, 1)
    measured = {}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for name, first, last in (("layer", False, False), ("embedding+layer", True, False), ("layer+head", False, True)):
            chunk = build_stage(model_args, one, pre_process=first, post_process=last, seed=config.training.seed, device=device)
            chunk.train()
            measured[name] = profile_part(chunk, task, config, device, first, last, iters)
            del chunk
    layer = measured["layer"]
    return {"layer": layer, "embedding": measured["embedding+layer"].minus(layer),
            "head": measured["layer+head"].minus(layer)}


def memory_budget(config: RunPlan, device: torch.device) -> float:
    """Bytes per stage: the flag, else the device's memory on GPU, else unlimited."""
    if config.parallel.pipeline_partition_memory_gb is not None:
        return config.parallel.pipeline_partition_memory_gb * 2**30
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return math.inf


def solve(parts: dict[str, PartProfile], num_layers: int, in_flight: list[float], budget: float,
          layout: PipelineLayout | None = None) -> Partition | ChunkPartition:
    """Per-layer costs (embedding on layer 0, head on the last layer), then the optimal split:
    per stage for one part per stage, per model part balancing the ranks for a chunked ``layout``
    (V, interleaved; :mod:`megatron.pipeline.costs.chunk_partition`)."""
    if layout is not None and layout.num_model_stages != layout.num_stages:
        owners = [layout.physical(v)[0] for v in range(layout.num_model_stages)]
        units = [Unit(p.time_ms, p.static_bytes, p.activation_bytes)
                 for p in (parts["layer"], parts["embedding"], parts["head"])]
        return partition_chunks(num_layers, owners, *units, in_flight, budget)
    layer = parts["layer"]
    times = [layer.time_ms] * num_layers
    static = [layer.static_bytes] * num_layers
    act = [layer.activation_bytes] * num_layers
    for index, part in ((0, parts["embedding"]), (num_layers - 1, parts["head"])):
        times[index] += part.time_ms
        static[index] += part.static_bytes
        act[index] += part.activation_bytes
    return partition_layers(times, static, act, in_flight, budget)


def describe(parts: dict[str, PartProfile], partition: Partition | ChunkPartition, in_flight: list[float]) -> str:
    mb = 2.0**20
    if isinstance(partition, ChunkPartition):
        times, memory, what = partition.rank_time, partition.rank_memory, "per chunk"
    else:
        times, memory, what = partition.stage_time, partition.stage_memory, ""
    budget = "unlimited" if math.isinf(partition.budget) else f"{partition.budget / mb:.1f} MB"
    lines = [
        "pipeline partition profiled: profiled per micro-batch (forward+backward ms, static MB, activation MB): "
        + ", ".join(f"{k} {p.time_ms:.2f} / {p.static_bytes / mb:.2f} / {p.activation_bytes / mb:.2f}"
                    for k, p in parts.items()),
        f"pipeline partition profiled: layer split {list(partition.counts)}{' ' + what if what else ''}; "
        f"predicted per-stage time (ms) "
        f"{[round(t, 2) for t in times]}, memory (MB) {[round(m / mb, 1) for m in memory]} "
        f"with {[round(w, 1) for w in in_flight]} micro-batches in flight, budget {budget}",
    ]
    if not partition.feasible:
        lines.append(f"pipeline partition profiled: WARNING no split fits the budget; the least-overshoot split "
                     f"exceeds it by {max(m - partition.budget for m in memory) / mb:.1f} MB on its worst stage")
    return "\n".join(f"[megatron-async] {line}" for line in lines)


def choose_split(task: PretrainTask, config: RunPlan, device: torch.device) -> list[int]:
    """Profile, solve, print; return the layer counts per stage."""
    if task.part_builder() is None:
        raise SystemExit(f"error: --pipeline-partition profiled profiles models built of layers (GPT, BERT); "
                         f"the {task.name} task's is not")
    parts = profile_parts(task, config, device)
    in_flight = schedule_in_flight(config)
    partition = solve(parts, config.model.num_layers, in_flight, memory_budget(config, device), config.run.layout)
    print(describe(parts, partition, in_flight), flush=True)
    return list(partition.counts)


def apply_auto_partition(task: PretrainTask, config: RunPlan, device: torch.device) -> RunPlan:
    """With ``--pipeline-partition profiled``, the plan with the profiled layer split (rank 0
    decides under torch.distributed and broadcasts, so all ranks build the same stages); else
    ``config``."""
    layers = config.layers
    if layers.partition != "profiled":
        return config
    if layers.counts is not None:  # resumed: the checkpoint's split (plan/partition.py)
        import torch.distributed as dist

        if layers.resumed and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"[megatron-async] pipeline partition profiled: resuming with the checkpoint's layer split "
                  f"{layers.counts}", flush=True)
        return config
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        box: list[object] = [choose_split(task, config, device) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
        split = box[0]
    else:
        split = choose_split(task, config, device)
    return dataclasses.replace(config, layers=dataclasses.replace(layers, counts=[int(c) for c in split]))  # type: ignore[union-attr]
