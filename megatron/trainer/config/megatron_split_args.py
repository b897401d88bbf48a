"""Megatron-LM's pipeline-split flags, mapped onto the layer split every run here uses.

Megatron-LM users' scripts carry these flags; each becomes per-stage layer counts
(``args.pipeline_layer_split``, or ``--num-layers-per-virtual-pipeline-stage`` for an even
virtual split), computed by the same rules as Megatron-LM (``megatron/training/arguments.py``,
``TransformerConfig.__post_init__`` and ``get_num_layers_to_build`` in megatron-core, and the
``pipeline_parallel_layout.md`` user guide):

* ``--decoder-first-pipeline-num-layers F`` / ``--decoder-last-pipeline-num-layers L``: the
  first (last) stage holds F (L) layers, each > 0; the rest split evenly over the middle stages
  (the remainder must divide evenly, and there are middle layers exactly when there are middle
  stages). Megatron refuses them with virtual stages unless their count is given by
  ``--num-virtual-stages-per-pipeline-rank``, a flag not accepted here, so they are refused with
  ``--num-layers-per-virtual-pipeline-stage``.
* ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``: the
  embedding (the loss) counts as one layer: ``(num_layers + E + L) / PP`` per stage, the first
  stage builds one layer less (the last stage too, for the loss). Not with first/last counts.
* ``--pipeline-model-parallel-layout``: ``|`` separates stages (PP x V of them, virtual stage
  ``v * PP + s`` is chunk v of stage s), ``E``/``t``/``L`` are embedding, transformer layer and
  loss, ``x*n`` and ``(...)*n`` repeat, commas are cosmetic (Megatron removes them before
  parsing; the virtual stages come from the number of ``|``-separated stages, not from commas).
  The embedding must be the first layer of virtual stage 0 and the loss the last of the last
  one (where our model puts them), once each; ``m`` (MTP) and unknown characters are refused.
  V > 1 maps onto our interleaving only with the same number of layers in every virtual stage.

A stage without transformer layers is refused: the layer split here keeps >= 1 per stage.
Every refusal is one line, before any rank starts.
"""
from __future__ import annotations

import argparse
import re

from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.values import FlagValue

FIRST, LAST = "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"
EMBEDDING, LOSS = "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"
LAYOUT = "--pipeline-model-parallel-layout"


def add_megatron_split_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pipeline split (Megatron-LM options)")
    g.add_argument(FIRST, type=int, default=None, metavar="N",
                   help="transformer layers on the first pipeline stage (the rest split evenly)")
    g.add_argument(LAST, type=int, default=None, metavar="N",
                   help="transformer layers on the last pipeline stage (the rest split evenly)")
    g.add_argument(EMBEDDING, action="store_true", help="the embedding counts as one layer in the even split")
    g.add_argument(LOSS, action="store_true", help="the loss counts as one layer in the even split")
    g.add_argument(LAYOUT, default=None, metavar="LAYOUT",
                   help='stages split by "|", E embedding, t transformer layer, L loss, x*n and (...)*n '
                        'repeat, commas cosmetic; e.g. "Et*3|t*4|t*4|t*3L"')


def uneven_split(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    """Megatron's ``--decoder-first/last-pipeline-num-layers`` split."""
    for flag, value in ((FIRST, first), (LAST, last)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be > 0, got {value}")
    if first is not None and last is not None and pp < 2:
        raise ConfigError(f"{FIRST} and {LAST} need --pipeline-model-parallel-size >= 2")
    middle_layers = num_layers - (first or 0) - (last or 0)
    middle_stages = pp - (first is not None) - (last is not None)
    if middle_layers < 0 or bool(middle_layers) != bool(middle_stages):
        raise ConfigError(f"{FIRST}/{LAST} leave {middle_layers} layers of --num-layers {num_layers} "
                          f"for {middle_stages} middle stages")
    if middle_stages and middle_layers % middle_stages:
        raise ConfigError(f"{FIRST}/{LAST} leave {middle_layers} layers, not divisible by the "
                          f"{middle_stages} middle stages")
    per = middle_layers // middle_stages if middle_stages else 0
    counts = [per] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def accounted_split(num_layers: int, pp: int, embedding: bool, loss: bool) -> list[int]:
    """Megatron's split with the embedding and/or the loss counted as one layer each."""
    total = num_layers + int(embedding) + int(loss)
    if total % pp:
        raise ConfigError(f"--num-layers {num_layers} + {int(embedding) + int(loss)} "
                          f"({EMBEDDING}/{LOSS}) is not divisible by --pipeline-model-parallel-size {pp}")
    counts = [total // pp] * pp
    counts[0] -= int(embedding)
    counts[-1] -= int(loss)
    return counts


_REPEAT_GROUP = re.compile(r"\(([^)]+)\)\*(\d+)")
_REPEAT_ONE = re.compile(r"(.)\*(\d+)")


def parse_layout(layout: str) -> list[str]:
    """The layout's stages, each a string of ``E``/``t``/``L``/``m`` (Megatron's unrolling rules)."""
    text = layout.replace(",", "")
    for pattern in (_REPEAT_GROUP, _REPEAT_ONE):
        text = pattern.sub(lambda m: m.group(1) * int(m.group(2)), text)
    stages = text.split("|")
    for stage in stages:
        for char in stage:
            if char not in "EtLm":
                raise ConfigError(f"{LAYOUT} {layout!r}: unknown layer {char!r} (E, t, L, |, (...)*n, x*n)")
    return stages


def layout_split(layout: str, num_layers: int, pp: int) -> list[int]:
    """Transformer layers per virtual stage (in model order) of a ``--pipeline-model-parallel-layout``."""
    stages = parse_layout(layout)
    if len(stages) % pp:
        raise ConfigError(f"{LAYOUT} {layout!r} has {len(stages)} stages, not a multiple of "
                          f"--pipeline-model-parallel-size {pp}")
    flat = "".join(stages)
    if "m" in flat:
        raise ConfigError(f"{LAYOUT} {layout!r}: MTP layers (m) are not supported here")
    if flat.count("E") != 1 or flat.count("L") != 1:
        raise ConfigError(f"{LAYOUT} {layout!r} needs exactly one E and one L")
    if not stages[0].startswith("E") or not stages[-1].endswith("L"):
        raise ConfigError(f"{LAYOUT} {layout!r}: E must open the first stage and L close the last "
                          f"(the embedding and the loss live there)")
    if flat.count("t") != num_layers:
        raise ConfigError(f"{LAYOUT} {layout!r} has {flat.count('t')} transformer layers, --num-layers is {num_layers}")
    return [stage.count("t") for stage in stages]


def _requested(args: argparse.Namespace) -> list[str]:
    given = [(FIRST, args.decoder_first_pipeline_num_layers is not None),
             (LAST, args.decoder_last_pipeline_num_layers is not None),
             (EMBEDDING, args.account_for_embedding_in_pipeline_split),
             (LOSS, args.account_for_loss_in_pipeline_split), (LAYOUT, args.pipeline_model_parallel_layout is not None)]
    return [flag for flag, on in given if on]


def _check_combinations(args: argparse.Namespace, flags: list[str]) -> None:
    """Megatron's exclusions, plus ours: one source of the split at a time."""
    if args.pipeline_layer_split is not None:
        raise ConfigError(f"{flags[0]} sets the layer split; drop --pipeline-layer-split")
    if args.pipeline_partition is not None:
        raise ConfigError(f"{flags[0]} sets the layer split; drop --pipeline-partition")
    if LAYOUT in flags and len(flags) > 1:
        raise ConfigError(f"{LAYOUT} cannot be combined with {[f for f in flags if f != LAYOUT][0]}")
    if {FIRST, LAST} & set(flags) and {EMBEDDING, LOSS} & set(flags):
        raise ConfigError(f"{FIRST}/{LAST} cannot be combined with {EMBEDDING}/{LOSS} (as in Megatron-LM)")
    if LAYOUT in flags and args.num_layers_per_virtual_pipeline_stage is not None:
        raise ConfigError(f"{LAYOUT} sets the virtual stages; drop --num-layers-per-virtual-pipeline-stage")
    if LAYOUT not in flags and args.num_layers_per_virtual_pipeline_stage is not None:
        raise ConfigError(f"{flags[0]} with --num-layers-per-virtual-pipeline-stage: Megatron-LM needs "
                          f"--num-virtual-stages-per-pipeline-rank for uneven virtual stages, not supported here")


def resolve_megatron_split(args: argparse.Namespace) -> dict[str, FlagValue]:
    """The Megatron-LM split flags as ``pipeline_layer_split`` (or, for an even virtual layout,
    ``num_layers_per_virtual_pipeline_stage``), with which flags in ``layer_split_source`` for
    the banner; ``{}`` without them. Runs before the model chunks are derived."""
    flags = _requested(args)
    if not flags or args.layer_split_source:  # none, or flags resolved already
        return {}
    _check_combinations(args, flags)
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    if LAYOUT in flags:
        counts = layout_split(args.pipeline_model_parallel_layout, layers, pp)
    elif {FIRST, LAST} & set(flags):
        counts = uneven_split(layers, pp, args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers)
    else:
        counts = accounted_split(layers, pp, args.account_for_embedding_in_pipeline_split,
                                 args.account_for_loss_in_pipeline_split)
    if 0 in counts:
        raise ConfigError(f"{flags[0]} gives the layer split {counts}: a stage without transformer "
                          f"layers is not supported here")
    if len(counts) > pp:
        if len(set(counts)) != 1:
            raise ConfigError(f"{LAYOUT}: virtual stages of {counts} layers; only the same number of "
                              f"layers in every virtual stage maps onto the interleaved chunks here")
        return {"num_layers_per_virtual_pipeline_stage": counts[0], "layer_split_source": " ".join(flags)}
    # spelled out even when even: the default balanced partition must not move it
    return {"pipeline_layer_split": counts, "layer_split_source": " ".join(flags)}
