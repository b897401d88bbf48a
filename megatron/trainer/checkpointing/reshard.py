"""Loading a checkpoint into another layout: pipeline size, data-parallel size, layer split, schedule.

Why this works at all: every parameter, and every piece of optimizer state that belongs to one
parameter (AdamW's moments and fp32 master, basis rotation's bases), is saved under the
parameter's *global* name (its name in the unsplit model). ``metadata.json`` carries an index
(``index``: rank file -> the names it holds, with shape, global shape and offset, and the
stage's update count), so a rank of the new layout finds the old files that hold its names,
reads only those (data-parallel replica 0's: replicas hold identical weights), checks their
SHA-256 and takes exactly its entries. The offset / global-shape fields are there for tensor
parallelism, whose shards are pieces of one global tensor; today every entry is whole.

What does not follow a parameter is decided here, per item (``docs/checkpoints.md``):

* update counts (the LR position, AdamW's bias correction): one per optimizer. Carried when
  the stages a new stage gathers from agree (synchronous schedules always do); refused when an
  asynchronous run's stages stepped different counts and the stage partition changes;
* the stage partition unchanged (same stage count, chunks and split; only the data-parallel
  size or the schedule differs): each new stage's RNG stream, drift histogram and loss scaler
  come from the old stage of the same index, and with the same schedule also its weight
  versions (2BW's stash, PipeMare's delta) and the schedule's profiled order;
* the partition changed: dropout RNG streams restart from ``--seed`` (per-stage streams have
  no meaning across stage counts), drift histograms start empty, the loss scale is the
  smallest of the gathered stages' scales;
* weight versions of another schedule or partition and zb's profiled order: reset (the
  first window reads the current weights, PipeMare's delta starts at 0, zb profiles again),
  each with a one-line notice;
* AMDP (replicated stages with ZeRO-sharded optimizer state): refused, its files hold parts of
  the optimizer state per device.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from megatron.pipeline.schedules import schedule_class
from megatron.trainer.checkpointing.paths import rank_file_name

# Flags that describe the layout, not the model: they may differ between save and load.
LAYOUT_FLAGS = ("pipeline_model_parallel_size", "num_model_chunks", "pipeline_layer_split",
                "data_parallel_size", "pipeline_schedule", "num_microbatches", "micro_batch_size")


class ReshardError(ValueError):
    """A layout change that cannot be loaded correctly; one line for the user."""


def global_batch(signature: dict[str, Any]) -> int | None:
    """Samples per iteration (the data position is iteration x this; must not change)."""
    parts = [signature.get(k) for k in ("micro_batch_size", "num_microbatches", "data_parallel_size")]
    if any(p is None for p in parts):
        return None
    return parts[0] * parts[1] * parts[2]


def partition(signature: dict[str, Any]) -> tuple[Any, ...]:
    """Which layers each stage holds: (stages, chunks, layers per stage), an even split spelled
    out, so ``--pipeline-layer-split 2 2`` and the default even split of 4 layers compare equal."""
    pp, chunks = signature.get("pipeline_model_parallel_size"), signature.get("num_model_chunks") or 1
    split, layers = signature.get("pipeline_layer_split"), signature.get("num_layers")
    if not split and chunks == 1 and isinstance(pp, int) and isinstance(layers, int) and pp > 0 and layers % pp == 0:
        split = [layers // pp] * pp
    return pp, chunks, tuple(split) if split else None


def describe(signature: dict[str, Any]) -> str:
    """A layout in a few words, for notices."""
    split = signature.get("pipeline_layer_split")
    chunks = signature.get("num_model_chunks") or 1
    return (f"PP{signature.get('pipeline_model_parallel_size')} DP{signature.get('data_parallel_size')}"
            f"{f' x{chunks} chunks' if chunks != 1 else ''}{f' split {split}' if split else ''}"
            f" {signature.get('pipeline_schedule')}")


def param_entry(name: str, shape: tuple[int, ...]) -> dict[str, Any]:
    """Index entry of one saved tensor: a whole tensor today; a TP shard would have its offset
    within ``global_shape`` and its own ``shape``."""
    return {"shape": list(shape), "global_shape": list(shape), "offset": [0] * len(shape)}


def file_index(state: dict[str, Any]) -> dict[str, Any]:
    """What ``metadata.json`` lists for one rank file (written by the rank beside its file)."""
    optimizer = state.get("optimizer") or {}
    model = state.get("model", {})
    return {"stage": state.get("stage"), "step_count": optimizer.get("step_count"),
            "optimizer_sharded": _sharded(optimizer.get("params", {}), model),
            "params": {name: param_entry(name, tuple(t.shape)) for name, t in model.items()}}


def _sharded(entries: dict[str, Any], model: dict[str, Any]) -> bool:
    """True when the file holds only part of some parameter's optimizer state (ZeRO-1 shards,
    AMDP §3.4, a distributed optimizer): such parts do not follow a parameter to a new rank."""
    return any(name in model and entry["exp_avg"].numel() != model[name].numel() for name, entry in entries.items())


@dataclass(frozen=True)
class ReshardPlan:
    """How this run's ranks take their state from a checkpoint of another layout."""

    saved: dict[str, Any]                      # the checkpoint's signature
    owners: dict[str, str]                     # global parameter name -> rank file holding it (DP 0)
    index: dict[str, dict[str, Any]]           # rank file -> its index entry
    same_partition: bool                       # same stages: per-stage state maps stage to stage
    same_schedule: bool
    load_optimizer: bool
    notices: tuple[str, ...] = field(default_factory=tuple)

    def files_for(self, names: list[str]) -> list[str]:
        """The rank files that hold ``names``, in stage order (each read once)."""
        return sorted({self.owners[n] for n in names if n in self.owners})

    def files_read(self, dp_size: int) -> set[str]:
        """Every file some rank of a run with ``dp_size`` replicas reads (checked up front): the
        owners, and with the same partition each replica's own stage file for its RNG."""
        needed = set(self.owners.values())
        if self.same_partition:
            needed |= {f for f, entry in self.index.items() for dp in range(dp_size)
                       if f == self.stage_file(entry["stage"], dp)}
        return needed

    def stage_file(self, stage: int, dp_rank: int) -> str | None:
        """The old rank file of the same stage (this replica's if it existed, else replica 0's)."""
        for name in (rank_file_name(stage, dp_rank), rank_file_name(stage, 0)):
            if name in self.index:
                return name
        return None


def plan(metadata: dict[str, Any], ours: dict[str, Any], args: argparse.Namespace, where: str) -> ReshardPlan:
    """Decide how to load ``metadata``'s checkpoint into the layout ``ours``; :class:`ReshardError`
    (one line naming ``where``) for what would resume wrongly. Called before any rank starts."""
    saved = metadata["signature"]
    if global_batch(saved) != global_batch(ours):
        raise ReshardError(f"checkpoint {where} was saved with a global batch of {global_batch(saved)} samples, "
                           f"this run has {global_batch(ours)} (the data position would not continue)")
    for name in (saved.get("pipeline_schedule"), ours.get("pipeline_schedule")):
        refusal = schedule_class(name).reshard_refusal if name else None
        if refusal:
            raise ReshardError(f"checkpoint {where}: {describe(saved)} cannot load into {describe(ours)} ({refusal})")
    index = metadata.get("index")
    if not index:
        raise ReshardError(f"checkpoint {where} has no parameter index (saved before reshardable checkpoints); "
                           f"load it with its own layout {describe(saved)}")
    if any(entry.get("optimizer_sharded") for entry in index.values()) and \
            not (getattr(args, "no_load_optim", False) or getattr(args, "finetune", False)):
        raise ReshardError(f"checkpoint {where}: its optimizer state is sharded over data-parallel replicas; "
                           f"load it with its own layout {describe(saved)} or pass --no-load-optim")
    replica0 = {f: entry for f, entry in index.items() if f.endswith("_dp0.pt")}
    owners = {name: f for f, entry in sorted(replica0.items()) for name in entry["params"]}
    same_partition = partition(saved) == partition(ours)
    same_schedule = saved.get("pipeline_schedule") == ours.get("pipeline_schedule")
    load_optimizer = not (getattr(args, "no_load_optim", False) or getattr(args, "finetune", False))
    counts = sorted({entry.get("step_count") for entry in replica0.values()}, key=str)
    if load_optimizer and not same_partition and len(counts) > 1:
        raise ReshardError(f"checkpoint {where}: its stages applied different update counts {counts} "
                           f"(stage-local steps), one optimizer cannot continue several; keep "
                           f"--pipeline-model-parallel-size/--pipeline-layer-split or pass --no-load-optim")
    return ReshardPlan(saved, owners, index, same_partition, same_schedule, load_optimizer,
                       tuple(_notices(saved, ours, same_partition, same_schedule, metadata)))


def _notices(saved: dict[str, Any], ours: dict[str, Any], same_partition: bool, same_schedule: bool,
             metadata: dict[str, Any]) -> list[str]:
    """One line per piece of state that is reset rather than carried."""
    notices = [f"resharding the checkpoint from {describe(saved)} to {describe(ours)}"]
    if not same_partition:
        notices.append("stage partition changed: dropout RNG streams restart from --seed, "
                       "drift histograms start empty")
    policies = {name for name in (saved.get("pipeline_schedule"), ours.get("pipeline_schedule"))
                if name and schedule_class(name).weight_policy_has_state}
    if policies and not (same_partition and same_schedule):
        notices.append(f"weight-version state of {'/'.join(sorted(policies))} reset (2BW's stash, "
                       f"PipeMare's delta start fresh)")
    if metadata.get("schedule_state") is not None and not (same_partition and same_schedule):
        notices.append("the schedule's profiled order is not carried over (profiled again)")
    return notices


def merge_optimizer_states(states: list[tuple[dict[str, Any], set[str]]], names: set[str]) -> dict[str, Any]:
    """One optimizer ``state_dict`` for the parameters ``names`` out of several old stages'.

    ``states`` pairs each old state dict with the parameter names its file held. A dict-valued
    entry keyed by parameter names (AdamW's ``params``, basis rotation's ``rotation``) is merged,
    keeping ``names``; anything else (``step_count``, ``rotation_config``) is the same for all
    sources (checked by :func:`plan` for the count) and taken from the first.
    """
    merged: dict[str, Any] = {}
    for state, held in states:
        for key, value in state.items():
            if isinstance(value, dict) and set(value) <= held:
                merged.setdefault(key, {}).update({n: v for n, v in value.items() if n in names})
            else:
                merged.setdefault(key, value)
    return merged


def smallest_scale(states: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The loss-scaler state with the smallest scale among ``states`` (the safe choice when
    stages with their own scales merge; equal under a global scaler)."""
    present = [s for s in states if s is not None]
    if not present:
        return None
    return min(present, key=lambda s: float(s["scale"]))
