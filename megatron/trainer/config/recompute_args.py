"""Megatron-LM's activation-recompute flags, with Megatron's semantics and checks.

* ``--recompute-granularity full``: each recomputed unit keeps only its input; the units come
  from ``--recompute-method`` (required) and ``--recompute-num-layers N`` (required):
  ``uniform`` recomputes every model chunk in units of N layers (N divides each chunk's
  layers), ``block`` recomputes the first N layers of each chunk one by one (N at most the
  largest chunk; a smaller chunk recomputes all its layers);
* ``--recompute-granularity selective`` (or Megatron-LM's ``--recompute-activations``):
  core attention only (``--recompute-modules core_attn``, Megatron's default); no method, no N;
* ``--recompute-stash-weights`` (ours, full only): the recomputation reads the weights the
  forward read, so asynchronous schedules keep their semantics without recompute (see
  ``docs/schedules.md``).

Numbers are checked per model chunk: a "stage" of Megatron's ``num_layers_per_pipeline_rank``
is one chunk here (one per stage, or one per virtual stage with interleaving).
"""
from __future__ import annotations

import argparse

from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.values import FlagValue
from megatron.trainer.config.job_config import JobConfig
from megatron.trainer.config.run_config import schedule_config
from megatron.trainer.config.schedule_args import chosen_schedule
from megatron.trainer.config.choices import (
    RECOMPUTE_GRANULARITIES as GRANULARITIES, RECOMPUTE_METHODS as METHODS, SELECTIVE_MODULES)


def add_recompute_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("activation recompute (Megatron-LM)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="selective recompute (= --recompute-granularity selective)")
    g.add_argument("--recompute-granularity", choices=GRANULARITIES, default=None,
                   help="full: keep only each recomputed unit's input; selective: recompute core attention")
    g.add_argument("--recompute-method", choices=METHODS, default=None,
                   help="full: uniform (units of --recompute-num-layers layers) or block (the first "
                        "--recompute-num-layers layers of each chunk)")
    g.add_argument("--recompute-num-layers", type=int, default=None, metavar="N",
                   help="full: layers per unit (uniform) or recomputed layers per chunk (block)")
    g.add_argument("--recompute-modules", nargs="+", default=None, metavar="MODULE",
                   help="selective: what to recompute (core_attn, the only one implemented)")
    g.add_argument("--recompute-stash-weights", action="store_true",
                   help="full: recompute on the weights the forward read (one copy per version in flight), "
                        "so asynchronous schedules compute the gradients they would without recompute")


def _chunk_layer_counts(args: argparse.Namespace) -> list[int]:
    """Layers of every model part of the schedule's layout (the unit megatron-core's blocks
    recompute over): one part per stage, one per virtual stage with interleaving, two per stage
    on a V (each stage's ``--pipeline-layer-split`` count halved between them)."""
    layout = chosen_schedule(args).traits.layout_of(schedule_config(args))
    split = layout.part_layer_split(args.pipeline_layer_split)
    if split is not None:
        return split
    parts = layout.num_model_stages
    return [args.num_layers // parts] * parts


def check_recompute_flags(args: argparse.Namespace) -> dict[str, FlagValue]:
    """One-line :class:`ConfigError` for a combination Megatron-LM (or this runtime) refuses;
    the granularity ``--recompute-activations`` gives (``{}`` without it)."""
    granularity = args.recompute_granularity
    resolved: dict[str, FlagValue] = {}
    if args.recompute_activations:
        if granularity == "full":
            raise ConfigError("--recompute-activations is selective recompute; it contradicts "
                              "--recompute-granularity full (give one of them)")
        granularity = resolved["recompute_granularity"] = "selective"
    method, n = args.recompute_method, args.recompute_num_layers
    if granularity is None:
        given = [f for f, v in (("--recompute-method", method), ("--recompute-num-layers", n),
                                ("--recompute-modules", args.recompute_modules),
                                ("--recompute-stash-weights", args.recompute_stash_weights)) if v]
        if given:
            raise ConfigError(f"{given[0]} needs --recompute-granularity full or selective")
        return resolved
    if granularity == "selective":
        _check_selective(args)
        return resolved
    if args.recompute_modules is not None:
        raise ConfigError("--recompute-modules is for --recompute-granularity selective")
    if method is None:
        raise ConfigError("--recompute-granularity full needs --recompute-method uniform or block")
    if n is None:
        raise ConfigError("--recompute-granularity full needs --recompute-num-layers N")
    if args.zb_memory_limit is not None:
        raise ConfigError("--zb-memory-limit cannot bound memory under --recompute-granularity full: the "
                          "Zero Bubble search takes W to keep no more than F, and with full recompute it "
                          "keeps more (use selective recompute, or drop the limit)")
    if args.pipeline_partition in ("profiled", "balanced"):
        raise ConfigError("--recompute-granularity full needs the layer split up front; "
                          f"--pipeline-partition {args.pipeline_partition} splits layers costed without recompute")
    counts = [c for c in _chunk_layer_counts(args) if c > 0]
    if method == "uniform":
        bad = [c for c in counts if c % n]
        if bad:
            raise ConfigError(f"--recompute-num-layers {n} must divide the layers of every model chunk "
                              f"with --recompute-method uniform (a chunk has {bad[0]})")
    elif n > max(counts):
        raise ConfigError(f"--recompute-num-layers {n} exceeds the {max(counts)} layers per model chunk "
                          "(--recompute-method block recomputes that many layers of each chunk)")
    return resolved


def _check_selective(args: argparse.Namespace) -> None:
    if args.recompute_method is not None:
        raise ConfigError("--recompute-method is not supported with --recompute-granularity selective "
                          "(Megatron-LM: selective recomputes core attention in every layer)")
    if args.recompute_num_layers is not None:
        raise ConfigError("--recompute-num-layers is for --recompute-granularity full "
                          "(selective recomputes every layer's core attention)")
    modules = args.recompute_modules or list(SELECTIVE_MODULES)
    unknown = [m for m in modules if m not in SELECTIVE_MODULES]
    if unknown:
        raise ConfigError(f"--recompute-modules {unknown[0]} is not implemented (only "
                          f"{', '.join(SELECTIVE_MODULES)})")
    if args.recompute_stash_weights:
        raise ConfigError("--recompute-stash-weights needs --recompute-granularity full (selective "
                          "recomputes core attention, which has no weights)")


def recompute_model_kwargs(config: JobConfig) -> dict[str, FlagValue]:
    """The :class:`~megatron.trainer.models.stage.TransformerArgs` recompute fields of the flags."""
    return dict(recompute_granularity=config.recompute.recompute_granularity,
                recompute_method=config.recompute.recompute_method,
                recompute_num_layers=config.recompute.recompute_num_layers,
                recompute_stash_weights=config.recompute.recompute_stash_weights)
