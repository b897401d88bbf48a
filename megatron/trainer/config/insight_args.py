"""Flags of the insight tools: run traces, activation accounting and the profiled layer partition.

* ``--trace-dir DIR``: every stage records its ops (``megatron.pipeline.runtime.tracing``) and writes
  ``DIR/stage{S}_dp{D}.json``; ``tools/merge_traces.py DIR`` turns them into a Chrome/Perfetto
  trace, a timeline PNG and measured bubble fractions.
* ``--log-activation-memory``: every stage counts the bytes autograd saves per micro-batch
  (``megatron.pipeline.runtime.memory``, a saved-tensor hook on every saved tensor) and the log
  reports the per-stage peak (``peak act (MB)``, JSON ``peak_activation_mb``). Off by default, so
  a run without it pays no hook; the in-flight micro-batch count is logged either way.
* ``--pipeline-partition balanced|even|profiled`` (``auto``: an alias of ``profiled``).
  ``balanced``, the default wherever it applies, splits the layers by the analytic cost model
  (``megatron.pipeline.costs.cost_model``: FLOPs of the layers, embedding, head and loss) with PACI's
  memory-constrained min-max partition (``megatron.pipeline.costs.partition``): deterministic from
  the flags, decided before any rank starts (``megatron.trainer.tasks.balanced_partition``).
  ``even`` gives every stage the same number of layers. ``profiled`` measures one layer, the
  embedding and the head on this device instead (GPT and BERT; the split can differ between
  runs and machines). ``--pipeline-layer-split`` overrides all of them; ``--pipeline-partition-memory-gb``
  bounds each stage's memory for ``balanced`` and ``profiled``. Resuming (``--load``) without
  ``--pipeline-partition`` keeps the checkpoint's split; an explicit ``balanced`` decides again
  (the checkpoint then loads resharded).
"""
from __future__ import annotations

import argparse

from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.job_config import build_job_config


PARTITIONS = ("balanced", "even", "profiled")


def _partition_name(value: str) -> str:
    """``auto`` (the flag's former name for profiling) is ``profiled``."""
    return "profiled" if value == "auto" else value


def add_insight_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("insight: traces and layer partition")
    g.add_argument("--trace-dir", default=None, metavar="DIR",
                   help="record every stage's op spans and write DIR/stage{S}_dp{D}.json "
                        "(merge with tools/merge_traces.py DIR --out trace.json --png timeline.png)")
    g.add_argument("--log-activation-memory", action="store_true",
                   help="count the bytes autograd saves per micro-batch (a saved-tensor hook per saved tensor) "
                        "and log each stage's peak (peak act (MB), JSON peak_activation_mb); off by default")
    g.add_argument("--pipeline-partition", choices=PARTITIONS, default=None, type=_partition_name,
                   help="balanced (default where it applies: one model part per stage, GPT or BERT, no full "
                        "recompute): minimise the slowest stage by the analytic FLOPs of layers, embedding, "
                        "head and loss; even: equal layers per stage; profiled (alias auto): measure the "
                        "costs on this device (GPT, BERT). --pipeline-layer-split overrides")
    g.add_argument("--pipeline-partition-memory-gb", type=float, default=None, metavar="GB",
                   help="per-stage memory budget for --pipeline-partition balanced or profiled (static + "
                        "in-flight activations); default unlimited (profiled on GPU: the device's memory)")
    g.add_argument("--pipeline-partition-profile-iters", type=int, default=3, metavar="R",
                   help="timed forward+backward passes per profiled part (after one warm-up pass)")


def check_insight_flags(args: argparse.Namespace) -> None:
    """Check the partition flags and decide the balanced split (sets ``args.pipeline_partition``
    to what applies, and ``args.pipeline_layer_split`` when balancing moves layers)."""
    _resolve_partition(args)
    if args.pipeline_partition != "profiled":
        return
    pp = args.pipeline_model_parallel_size
    if hasattr(args, "synthetic_forward_ms"):
        raise ConfigError("--pipeline-partition profiled profiles GPT and BERT layers; this task has none")
    if args.num_layers < pp:
        raise ConfigError(f"--pipeline-partition profiled needs --num-layers {args.num_layers} >= "
                          f"--pipeline-model-parallel-size {pp} (one layer per stage at least)")
    if args.num_model_chunks != 1:
        raise ConfigError("--pipeline-partition profiled splits one chunk per stage; "
                          "interleaved schedules need the even split")
    if args.pipeline_partition_profile_iters < 1:
        raise ConfigError("--pipeline-partition-profile-iters must be >= 1")
    from megatron.trainer.tasks.balanced_partition import checkpoint_split

    _, split = checkpoint_split(build_job_config(args))  # resuming: keep the split the weights were saved with
    if split is not None and len(split) == pp and sum(split) == args.num_layers:
        args.pipeline_layer_split = split
        args.pipeline_partition_resumed = True


def _resolve_partition(args: argparse.Namespace) -> None:
    """The partition that applies: ``explicit`` for the user's ``--pipeline-layer-split``,
    ``checkpoint`` for a resumed run's, the default ``balanced`` where it applies, else ``even``;
    an explicit choice that cannot apply is refused."""
    from megatron.trainer.tasks.balanced_partition import balanced_split, checkpoint_split, why_not_balanced

    asked = args.pipeline_partition
    memory = args.pipeline_partition_memory_gb
    if memory is not None and memory <= 0:
        raise ConfigError("--pipeline-partition-memory-gb must be > 0")
    if args._balanced_split:  # checked before: decide again from the flags
        args.pipeline_layer_split, asked = None, "balanced"
    if args.pipeline_layer_split is not None:
        if asked in ("balanced", "profiled"):
            raise ConfigError(f"--pipeline-partition {asked} chooses the split; drop --pipeline-layer-split")
        args.pipeline_partition = "explicit"
    elif asked in (None, "balanced"):
        flags = build_job_config(args)  # the split's inputs (none of them is set below)
        reason = why_not_balanced(flags)
        if reason is not None and asked == "balanced":
            raise ConfigError(f"--pipeline-partition balanced cannot apply: {reason}")
        args.pipeline_partition = "even" if reason is not None else "balanced"
        resumed, split = checkpoint_split(flags) if asked is None and reason is None else (False, None)
        if resumed:  # the default keeps a checkpoint's split (even before the balanced default)
            args.pipeline_layer_split, args.pipeline_partition = split, "checkpoint"
        elif reason is None:
            split, args.pipeline_partition_feasible = balanced_split(flags)
            if split is not None:
                args.pipeline_layer_split = split
                args._balanced_split = True  # not the user's: a second check of the flags decides it again
    if memory is not None and args.pipeline_partition in ("even", "explicit"):
        raise ConfigError("--pipeline-partition-memory-gb needs --pipeline-partition balanced or profiled")
