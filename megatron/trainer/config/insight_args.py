"""Flags of the insight tools: run traces and the profiled layer partition.

* ``--trace-dir DIR``: every stage records its ops (``megatron.pipeline.runtime.tracing``) and writes
  ``DIR/stage{S}_dp{D}.json``; ``tools/merge_traces.py DIR`` turns them into a Chrome/Perfetto
  trace, a timeline PNG and measured bubble fractions.
* ``--pipeline-partition even|auto``: ``even`` is the existing split (even, or
  ``--pipeline-layer-split``); ``auto`` profiles one transformer layer, the embedding and the
  head on this device and solves PACI's memory-constrained min-max partition
  (``megatron.pipeline.partition``), under ``--pipeline-partition-memory-gb`` per stage.
"""
from __future__ import annotations

import argparse


class InsightArgumentError(ValueError):
    """A bad tracing / partition flag; one line for the user."""


def add_insight_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("insight: traces and layer partition")
    g.add_argument("--trace-dir", default=None, metavar="DIR",
                   help="record every stage's op spans and write DIR/stage{S}_dp{D}.json "
                        "(merge with tools/merge_traces.py DIR --out trace.json --png timeline.png)")
    g.add_argument("--pipeline-partition", choices=["even", "auto"], default="even",
                   help="even: equal layers per stage (or --pipeline-layer-split); auto: profile layer "
                        "time and memory on this device and minimise the slowest stage under the memory budget")
    g.add_argument("--pipeline-partition-memory-gb", type=float, default=None, metavar="GB",
                   help="per-stage memory budget for --pipeline-partition auto (static + in-flight "
                        "activations); default: the device's memory on GPU, unlimited on CPU")
    g.add_argument("--pipeline-partition-profile-iters", type=int, default=3, metavar="R",
                   help="timed forward+backward passes per profiled part (after one warm-up pass)")


def validate_insight_args(args: argparse.Namespace) -> None:
    if getattr(args, "pipeline_partition", "even") != "auto":
        if args.pipeline_partition_memory_gb is not None:
            raise InsightArgumentError("--pipeline-partition-memory-gb needs --pipeline-partition auto")
        return
    pp = args.pipeline_model_parallel_size
    if args.pipeline_layer_split is not None:
        raise InsightArgumentError("--pipeline-partition auto chooses the split; drop --pipeline-layer-split")
    if args.num_layers < pp:
        raise InsightArgumentError(f"--pipeline-partition auto needs --num-layers {args.num_layers} >= "
                                   f"--pipeline-model-parallel-size {pp} (one layer per stage at least)")
    if getattr(args, "num_model_chunks", 1) != 1:
        raise InsightArgumentError("--pipeline-partition auto splits one chunk per stage; "
                                   "interleaved schedules need the even split")
    if args.pipeline_partition_memory_gb is not None and args.pipeline_partition_memory_gb <= 0:
        raise InsightArgumentError("--pipeline-partition-memory-gb must be > 0")
    if args.pipeline_partition_profile_iters < 1:
        raise InsightArgumentError("--pipeline-partition-profile-iters must be >= 1")
    from megatron.trainer.tasks.auto_partition import split_from_checkpoint

    split = split_from_checkpoint(args)  # resuming: keep the split the weights were saved with
    if split is not None and len(split) == pp and sum(split) == args.num_layers:
        args.pipeline_layer_split = split
        args.pipeline_partition_resumed = True
