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
  the flags, decided before any rank starts (``megatron.trainer.tasks.balanced_partition``, applied by
  :mod:`megatron.trainer.plan.partition`).
  ``even`` gives every stage the same number of layers. ``profiled`` measures one layer, the
  embedding and the head on this device instead (GPT and BERT; the split can differ between
  runs and machines). ``--pipeline-layer-split`` overrides all of them; ``--pipeline-partition-memory-gb``
  bounds each stage's memory for ``balanced`` and ``profiled``. Resuming (``--load``) without
  ``--pipeline-partition`` keeps the checkpoint's split; an explicit ``balanced`` decides again
  (the checkpoint then loads resharded).
"""
from __future__ import annotations

import argparse



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
