"""The planner's search space: schedule x micro-batch size x virtual stages x recompute x split.

Why these axes: at a fixed global batch and data-parallel size they are what the trainer's
flags choose besides the schedule, and each moves the throughput-memory trade-off (more
micro-batches shrink the bubble and each micro-batch's activations; interleaving shrinks the
bubble and adds P2P; recompute trades B time for memory; the split trades the first and last
stages' embedding and head against their layers).

Layer splits (layers per model part; AMDP's replicated pipelines split evenly, as the trainer does):

* ``balanced``: the trainer's default, PACI's min-max split of the analytic per-layer FLOPs for
  one part per stage, the per-rank balanced split over the chunks for V and interleaved layouts
  (:func:`~megatron.trainer.tasks.balanced_partition.balanced_partition`'s solvers and inputs);
* ``even``: ``L / N`` layers per stage (``--pipeline-partition even``);
* ``offset``: Megatron's first/last-stage offsets (``--decoder-first/last-pipeline-num-layers``):
  the first and the last stage one layer fewer, given to their neighbours (N = 2: the last
  stage's layer goes to the first); passed as ``--pipeline-layer-split``.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from megatron.pipeline.costs.chunk_partition import partition_chunks
from megatron.pipeline.costs.cost_model import ModelShape, layer_costs, layer_units
from megatron.pipeline.costs.partition import partition_layers
from megatron.pipeline.ir import MultiPipelineLayout, PipelineLayout
from megatron.pipeline.schedules import SCHEDULES, ScheduleConfig, ScheduleConfigError, ScheduleOptions, schedule_class

SPLITS = ("balanced", "even", "offset")
RECOMPUTES = ("none", "selective", "full")


@dataclass(frozen=True)
class Candidate:
    """One configuration the trainer can run; ``counts``: layers per model part."""

    schedule: str
    pipeline_model_parallel_size: int
    micro_batch_size: int
    microbatches: int
    virtual_stages: int  # model chunks per stage
    recompute: str
    layer_split: str
    counts: tuple[int, ...] = field(default=())

    @property
    def asynchronous(self) -> bool:
        return schedule_class(self.schedule).traits.asynchronous

    def config(self, num_iterations: int, options: ScheduleOptions | None = None,
               data_parallel: int = 1) -> ScheduleConfig:
        chunks = self.virtual_stages if schedule_class(self.schedule).traits.takes_model_chunks else 1
        return ScheduleConfig(self.pipeline_model_parallel_size, self.microbatches, num_iterations=num_iterations,
                              num_chunks=chunks, options=options or ScheduleOptions(),
                              data_parallel_size=data_parallel)


def even_split(num_layers: int, parts: int) -> tuple[int, ...] | None:
    return (num_layers // parts,) * parts if num_layers % parts == 0 and num_layers >= parts else None


def offset_split(num_layers: int, stages: int) -> tuple[int, ...] | None:
    """First and last stage one layer fewer (module docstring); None where it cannot apply."""
    even = even_split(num_layers, stages)
    if even is None or even[0] < 2 or stages < 2:
        return None
    counts = list(even)
    if stages == 2:
        return (counts[0] + 1, counts[1] - 1)
    counts[0] -= 1
    counts[-1] -= 1
    counts[1] += 1
    counts[-2] += 1
    return tuple(counts)


def balanced_split(shape: ModelShape, stages: int) -> tuple[int, ...] | None:
    """The trainer's default split without a memory budget (same solver, same inputs)."""
    if shape.num_layers < stages:
        return None
    costs = layer_costs(shape)
    return partition_layers(costs.time, costs.static, costs.activation, [1.0] * stages).counts


def chunk_balanced_split(shape: ModelShape, layout: PipelineLayout) -> tuple[int, ...] | None:
    """The trainer's default split of a chunked layout without a memory budget (same solver, same inputs)."""
    if shape.num_layers < layout.num_model_stages:
        return None
    owners = [layout.physical(v)[0] for v in range(layout.num_model_stages)]
    return partition_chunks(shape.num_layers, owners, *layer_units(shape), [1.0] * layout.num_stages).counts


def layer_splits(shape: ModelShape, stages: int, parts: int, chunked: bool = False,
                 layout: PipelineLayout | None = None) -> dict[str, tuple[int, ...]]:
    """The splits that apply, by name; a chunked layout (``chunked``: interleaved, V, AMDP)
    splits evenly over its ``parts`` or, given its ``layout`` and not AMDP's replicas, balanced
    per rank."""
    if chunked:
        even = even_split(shape.num_layers, parts)
        found = {} if even is None else {"even": even}
        if layout is not None and not isinstance(layout, MultiPipelineLayout):
            balanced = chunk_balanced_split(shape, layout)
            if balanced is not None:
                found = {"balanced": balanced, **found}
        return found
    found = {"balanced": balanced_split(shape, stages), "even": even_split(shape.num_layers, stages),
             "offset": offset_split(shape.num_layers, stages)}
    return {name: counts for name, counts in found.items() if counts is not None}


def micro_batch_sizes(global_batch: int, data_parallel: int, limit: int = 16) -> list[int]:
    """Powers of two up to ``limit`` that divide a replica's share of the global batch."""
    per_replica, sizes, b = global_batch // data_parallel, [], 1
    while b <= min(limit, per_replica):
        if per_replica % b == 0:
            sizes.append(b)
        b *= 2
    return sizes


def chunk_counts(schedule: str, num_layers: int, stages: int, max_chunks: int = 4) -> list[int]:
    """Model chunks per stage a schedule can take: 1; the V's 2; interleaving's 2..max_chunks
    where the layers divide."""
    cls = schedule_class(schedule)
    if not cls.traits.takes_model_chunks:
        return [1]
    return [v for v in range(2, max_chunks + 1) if num_layers % (stages * v) == 0]


def enumerate_candidates(shape: ModelShape, pipeline_sizes: Sequence[int], global_batch: int, data_parallel: int,
                         schedules: Sequence[str] | None = None, recomputes: Sequence[str] = RECOMPUTES,
                         splits: Sequence[str] = SPLITS, micro_batch_limit: int = 16,
                         ) -> Iterator[tuple[Candidate | None, str]]:
    """Every candidate of the grid (``(candidate, "")``), and each combination a schedule's own
    check refuses (``(None, reason)``), so the report can say why a schedule is missing."""
    import dataclasses

    for n in pipeline_sizes:
        for name in schedules or list(SCHEDULES):
            cls = schedule_class(name)
            for b in micro_batch_sizes(global_batch, data_parallel, micro_batch_limit):
                m = global_batch // (data_parallel * b)
                for v in chunk_counts(name, shape.num_layers, n):
                    probe = Candidate(name, n, b, m, v, "none", "even")
                    try:
                        config = probe.config(1, data_parallel=data_parallel)
                        cls.check_config(dataclasses.replace(config, num_iterations=None) if cls.traits.asynchronous
                                         else config)
                        layout = cls.traits.layout_of(config)
                    except ScheduleConfigError as e:
                        yield None, str(e)
                        continue
                    chunked = layout.num_chunks > 1
                    for split, counts in layer_splits(shape, n, layout.num_model_stages, chunked, layout).items():
                        if split not in splits:
                            continue
                        for r in recomputes:
                            if r == "full" and split == "balanced":
                                continue  # the trainer refuses it: full recompute needs the even split
                            yield dataclasses.replace(probe, recompute=r, layer_split=split, counts=counts), ""
