"""Loading a checkpoint into another layout: pipeline size, data-parallel size, tensor-parallel
size, layer split, schedule.

Why this works at all: every parameter, and every piece of optimizer state that belongs to one
parameter (AdamW's moments and fp32 master, basis rotation's bases), is saved under the
parameter's *global* name (its name in the unsplit model). ``metadata.json`` carries an index
(``index``: rank file -> the names it holds, with shape, global shape and offset, and the
stage's update count), so a rank of the new layout finds the old files that hold its names,
reads only those (data-parallel replica 0's: replicas hold identical weights), checks their
SHA-256 and takes exactly its entries. A tensor-parallel run's files hold TP shards, listed
with their offset, stride and TP rank in the global tensor; a rank of another TP size
assembles its region from the shards that overlap it (:mod:`megatron.trainer.checkpointing.shards`),
parameters and optimizer moments alike. Replicated parameters are in every TP rank's file;
TP rank 0's copy is read.

What does not follow a parameter is decided here, per item (``docs/checkpoints.md``):

* update counts (the LR position, AdamW's bias correction): one per optimizer. Carried when
  the stages a new stage gathers from agree (synchronous schedules always do); refused when an
  asynchronous run's stages stepped different counts and the stage partition changes;
* the stage partition unchanged (same stage count, chunks, split and model parts per stage;
  only the data-parallel size or the schedule differs): each new stage's RNG stream, drift histogram and loss scaler
  come from the old stage of the same index, and with the same schedule also its weight
  versions (2BW's stash, PipeMare's delta) and the schedule's profiled order;
* the partition changed: dropout RNG streams restart from ``--seed`` (per-stage streams have
  no meaning across stage counts), drift histograms start empty, the loss scale is the
  smallest of the gathered stages' scales;
* the TP size changed: per-rank tensors that are not parameters (RNG streams, 2BW's stash,
  PipeMare's delta) reset as for a partition change; basis rotation's bases (computed on a
  shard) are refused unless ``--no-load-optim``; the padded vocabulary (divisible by
  ``--make-vocab-size-divisible-by`` x TP) may change: saved padding rows past this run's
  vocabulary are dropped, rows the checkpoint lacks keep this run's initialisation;
* weight versions of another schedule or partition and zb's profiled order: reset (the
  first window reads the current weights, PipeMare's delta starts at 0, zb profiles again),
  each with a one-line notice;
* sharded optimizer state (AMDP's replicas, ZeRO-1 over a stage's replicas, paper §3.4;
  ``--use-distributed-optimizer``): gathered at save, so a file holds each of its parameters'
  whole state and the checkpoint reshards like any other, optimizer included; a sharded run
  cuts its own ranges out on load (:func:`megatron.pipeline.runtime.replicas.owned_optimizer_state`,
  ``DataParallelShardedOptimizer.load_state_dict``), and the same layout resumes bitwise. An
  AMDP device hosts one logical stage of each pipeline (:func:`partition`), so AMDP and a single
  pipeline of the same size are different partitions; each AMDP file holds D/2 logical stages,
  every parameter sits in D/2 files (one per replica) and the first of them is read.
  Still refused: checkpoints written before the gather (their files hold parts of the optimizer
  state, marked ``optimizer_sharded`` in the index) into another layout, unless
  ``--no-load-optim``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron.pipeline.schedules import SchedulePolicy, schedule_class
from megatron.pipeline.schedules.base import ScheduleConfig
from megatron.trainer.checkpointing.paths import rank_file_coordinates, rank_file_name
from megatron.trainer.checkpointing.shards import Region, ShardError, plan_region, shard_entry
from megatron.trainer.config.run_plan import RunPlan, is_rebuild_decision
from megatron.trainer.models.tensor_parallel import ShardLayout

# Flags that describe the layout, not the model: they may differ between save and load.
LAYOUT_FLAGS = ("pipeline_model_parallel_size", "num_model_chunks", "pipeline_layer_split",
                "data_parallel_size", "pipeline_schedule", "num_microbatches", "micro_batch_size",
                "tensor_model_parallel_size")
# The padded vocabulary and the tokenizer's own size: checked by :func:`check_vocab` (padding
# may change with the TP size, the tokenizer may not).
VOCAB_FLAGS = ("vocab_size", "tokenizer_vocab_size")
# Recorded for tools, never compared: a run may load a checkpoint saved with another
# tokenizer of the same size (:func:`check_vocab` compares the sizes).
RECORD_FLAGS = ("tokenizer",)
# Run settings that do not shape the weights: a weights-only checkpoint (``imported_from``, as
# ``tools/import_hf.py`` writes) records none of them, and any value loads it.
RUN_ONLY_FLAGS = ("seq_length", "bf16", "fp16")
# Signature entries of checkpoints saved before the flag was recorded.
SIGNATURE_DEFAULTS = {"tensor_model_parallel_size": 1, "untie_embeddings_and_output_weights": True}


class ReshardError(ValueError):
    """A layout change that cannot be loaded correctly; one line for the user."""


def saved_signature(metadata: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's signature, with the values older checkpoints did not record (TP 1)."""
    return {**SIGNATURE_DEFAULTS, **metadata["signature"]}


def unchecked_flags(saved: dict[str, Any]) -> tuple[str, ...]:
    """Signature entries a load does not compare with the run's (besides layout and vocabulary)."""
    return RECORD_FLAGS + (RUN_ONLY_FLAGS if saved.get("imported_from") else ())


def tp_size(signature: dict[str, Any]) -> int:
    """The tensor-parallel size a signature records (1 when absent)."""
    return int(signature.get("tensor_model_parallel_size") or 1)


def check_vocab(saved: dict[str, Any], ours: dict[str, Any], where: str) -> bool:
    """True if the padded vocabularies differ only in padding (the same tokenizer, padded for
    another TP size); False if they are equal; :class:`ReshardError` if the vocabulary differs."""
    if saved.get("vocab_size") == ours.get("vocab_size"):
        return False
    true = saved.get("tokenizer_vocab_size")
    if true is None or true != ours.get("tokenizer_vocab_size") or \
            true > min(saved.get("vocab_size") or 0, ours.get("vocab_size") or 0):
        raise ReshardError(f"checkpoint {where} was saved with --vocab-size {saved.get('vocab_size')}, "
                           f"this run has {ours.get('vocab_size')}")
    return True


def global_batch(signature: dict[str, Any]) -> int | None:
    """Samples per iteration (the data position is iteration x this; must not change)."""
    parts = [signature.get(k) for k in ("micro_batch_size", "num_microbatches", "data_parallel_size")]
    if any(p is None for p in parts):
        return None
    return parts[0] * parts[1] * parts[2]


def schedule_policy(signature: dict[str, Any]) -> SchedulePolicy | None:
    """The policy of the signature's schedule for its stages and chunks (None: no schedule
    recorded); the schedule's options are not in a signature, and nothing read here needs them."""
    name = signature.get("pipeline_schedule")
    if not name:
        return None
    pp, chunks = signature.get("pipeline_model_parallel_size"), signature.get("num_model_chunks") or 1
    stages = pp if isinstance(pp, int) and pp > 0 else 1
    return schedule_class(name).traits.policy_for(ScheduleConfig(num_stages=stages, num_microbatches=1,
                                                                 num_chunks=chunks))


def partition(signature: dict[str, Any]) -> tuple[Any, ...]:
    """Which layers each stage holds: (stages, chunks, layers per model part, the model parts
    each stage hosts), an even split spelled out, so ``--pipeline-layer-split 2 2`` and the
    default even split of 4 layers compare equal. The parts come from the schedule's layout:
    an AMDP device hosts one logical stage of each of its D/2 pipelines (device 0 of four: parts
    0 and 3), not the part of the same index, so its files are no stage-for-stage match for a
    single pipeline of the same size."""
    pp, chunks = signature.get("pipeline_model_parallel_size"), signature.get("num_model_chunks") or 1
    split, layers = signature.get("pipeline_layer_split"), signature.get("num_layers")
    if not split and chunks == 1 and isinstance(pp, int) and isinstance(layers, int) and pp > 0 and layers % pp == 0:
        split = [layers // pp] * pp
    hosted = None
    policy = schedule_policy(signature)
    if policy is not None and isinstance(pp, int) and pp > 0:
        layout = policy.layout
        hosted = tuple(tuple(layout.model_stage(s, c) for c in range(layout.num_chunks)) for s in range(pp))
        if hosted == tuple((s,) for s in range(pp)):
            hosted = None  # one part per stage, in order: what a signature without a schedule means
    return pp, chunks, tuple(split) if split else None, hosted


def describe(signature: dict[str, Any]) -> str:
    """A layout in a few words, for notices."""
    split = signature.get("pipeline_layer_split")
    chunks = signature.get("num_model_chunks") or 1
    tp = tp_size(signature)
    return (f"{f'TP{tp} ' if tp != 1 else ''}"
            f"PP{signature.get('pipeline_model_parallel_size')} DP{signature.get('data_parallel_size')}"
            f"{f' x{chunks} chunks' if chunks != 1 else ''}{f' split {split}' if split else ''}"
            f" {signature.get('pipeline_schedule')}")


def param_entry(name: str, shape: tuple[int, ...], layout: ShardLayout | None = None, tp_rank: int = 0,
                tp_size_: int = 1) -> dict[str, Any]:
    """Index entry of one saved tensor: whole, or a TP shard with its offset, stride and TP rank
    in ``global_shape`` (:func:`megatron.trainer.checkpointing.shards.shard_entry`)."""
    return shard_entry(shape, layout, tp_rank, tp_size_)


def file_index(state: dict[str, Any]) -> dict[str, Any]:
    """What ``metadata.json`` lists for one rank file (written by the rank beside its file).
    ``state["tensor_parallel"]`` (TP rank, size and each sharded parameter's dim and stride)
    describes TP shards; without it every tensor is whole."""
    optimizer = state.get("optimizer") or {}
    model = state.get("model", {})
    tp = state.get("tensor_parallel") or {"rank": 0, "size": 1, "layouts": {}}
    layouts = {name: ShardLayout(*dim_stride) for name, dim_stride in tp["layouts"].items()}
    return {"stage": state.get("stage"), "step_count": optimizer.get("step_count"),
            "optimizer_sharded": "data_parallel_shard" in optimizer or _sharded(optimizer.get("params", {}), model),
            "params": {name: param_entry(name, tuple(t.shape), layouts.get(name), tp["rank"], tp["size"])
                       for name, t in model.items()}}


def _sharded(entries: dict[str, Any], model: dict[str, Any]) -> bool:
    """True when the file holds only part of some parameter's optimizer state (ZeRO-1 shards,
    AMDP §3.4, a distributed optimizer): such parts do not follow a parameter to a new rank."""
    return any(name in model and entry["exp_avg"].numel() != model[name].numel() for name, entry in entries.items())


@dataclass(frozen=True)
class ReshardPlan:
    """How this run's ranks take their state from a checkpoint of another layout."""

    saved: dict[str, Any]                      # the checkpoint's signature
    owners: dict[str, str]                     # global parameter name -> rank file holding it (DP 0, TP 0)
    index: dict[str, dict[str, Any]]           # rank file -> its index entry
    same_partition: bool                       # same stages: per-stage state maps stage to stage
    same_schedule: bool
    load_optimizer: bool
    notices: tuple[str, ...] = field(default_factory=tuple)
    holders: dict[str, tuple[str, ...]] = field(default_factory=dict)  # name -> DP 0 files, by TP rank
    same_tp: bool = True                       # same TP size: per-rank state maps rank to rank
    vocab: tuple[int, int] = (0, 0)            # padded vocabulary (saved, this run)

    @property
    def keeps_rank_state(self) -> bool:
        """Whether each new rank has an old twin (same stage and TP rank) whose RNG stream,
        weight versions and profiled costs it continues."""
        return self.same_partition and self.same_tp

    def region(self, name: str, layout: ShardLayout | None, tp_rank: int, tp_size_: int,
               shape: tuple[int, ...]) -> Region:
        """Where TP rank ``tp_rank`` of ``tp_size_`` finds its part of ``name`` (local ``shape``,
        sharded as ``layout``): the saved files that overlap it and which blocks to copy."""
        files = self.holders.get(name) or (self.owners[name],)
        try:
            return plan_region(name, [(f, self.index[f]["params"][name]) for f in files], layout,
                               tp_rank, tp_size_, shape, self.vocab)
        except ShardError as exc:
            raise ReshardError(f"checkpoint file {files[0]}: {exc}") from None

    def files_read(self, dp_size: int, tp_size_: int = 1) -> set[str]:
        """Every file some rank of a run with ``dp_size`` replicas (and ``tp_size_`` TP ranks)
        reads (checked up front): the holders, and with the same partition each rank's own
        stage file for its RNG."""
        needed = set(self.owners.values()) | {f for files in self.holders.values() for f in files}
        if self.same_partition:
            needed |= {f for f, entry in self.index.items() for dp in range(dp_size) for tp in range(tp_size_)
                       if f == self.stage_file(entry["stage"], dp, tp)}
        return needed

    def stage_file(self, stage: int, dp_rank: int, tp_rank: int = 0) -> str | None:
        """The old rank file of the same stage (this replica's if it existed, else replica 0's;
        the same TP rank if the TP size is unchanged, else TP rank 0's)."""
        saved_tp = tp_size(self.saved)
        tp = tp_rank if self.same_tp else 0
        for name in (rank_file_name(stage, dp_rank, tp, saved_tp), rank_file_name(stage, 0, tp, saved_tp)):
            if name in self.index:
                return name
        return None


def plan(metadata: dict[str, Any], ours: dict[str, Any], config: RunPlan, where: str) -> ReshardPlan:
    """Decide how to load ``metadata``'s checkpoint into the layout ``ours``; :class:`ReshardError`
    (one line naming ``where``) for what would resume wrongly. Called before any rank starts."""
    saved = saved_signature(metadata)
    vocab_padding = check_vocab(saved, ours, where)
    finetune = config.checkpoint.finetune  # starts at iteration 0: no data position to continue
    if not finetune and global_batch(saved) != global_batch(ours):
        raise ReshardError(f"checkpoint {where} was saved with a global batch of {global_batch(saved)} samples, "
                           f"this run has {global_batch(ours)} (the data position would not continue)")
    for signature in (saved, ours):
        policy = schedule_policy(signature)
        refusal = None if policy is None else policy.reshard_refusal
        if refusal:
            raise ReshardError(f"checkpoint {where}: {describe(saved)} cannot load into {describe(ours)} ({refusal})")
    index = metadata.get("index")
    if not index:
        raise ReshardError(f"checkpoint {where} has no parameter index (saved before reshardable checkpoints); "
                           f"load it with its own layout {describe(saved)}")
    if any(entry.get("optimizer_sharded") for entry in index.values()) and \
            not (config.checkpoint.no_load_optim or config.checkpoint.finetune):
        raise ReshardError(f"checkpoint {where}: its optimizer state is sharded over replicas (saved before "
                           f"checkpoints gathered the shards); load it with its own layout {describe(saved)} "
                           f"or pass --no-load-optim")
    replica0 = {f: entry for f, entry in index.items() if (rank_file_coordinates(f) or (0, 1, 0))[1] == 0}
    holders: dict[str, tuple[str, ...]] = {}
    for f in sorted(replica0, key=lambda f: rank_file_coordinates(f) or (0, 0, 0)):
        for name in replica0[f]["params"]:  # one stage's TP ranks (the first stage holding it)
            if name not in holders or replica0[holders[name][0]]["stage"] == replica0[f]["stage"]:
                holders[name] = (*holders.get(name, ()), f)
    owners = {name: files[0] for name, files in holders.items()}
    same_partition = partition(saved) == partition(ours)
    same_schedule = saved.get("pipeline_schedule") == ours.get("pipeline_schedule")
    same_tp = tp_size(saved) == tp_size(ours)
    load_optimizer = not (config.checkpoint.no_load_optim or config.checkpoint.finetune)
    if load_optimizer and not same_tp and config.optimizer.optimizer == "basis-rotation":
        raise ReshardError(f"checkpoint {where}: basis rotation's bases belong to one tensor-parallel shard, "
                           f"they do not reshard from TP{tp_size(saved)} to TP{tp_size(ours)}; keep "
                           f"--tensor-model-parallel-size {tp_size(saved)} or pass --no-load-optim")
    counts = sorted({entry.get("step_count") for entry in replica0.values()}, key=str)
    if load_optimizer and not same_partition and len(counts) > 1:
        raise ReshardError(f"checkpoint {where}: its stages applied different update counts {counts} "
                           f"(stage-local steps), one optimizer cannot continue several; keep "
                           f"--pipeline-model-parallel-size/--pipeline-layer-split or pass --no-load-optim")
    vocab = (saved.get("vocab_size") or 0, ours.get("vocab_size") or 0)
    notices = _notices(saved, ours, same_partition and same_tp, same_schedule, metadata)
    if vocab_padding:
        notices.append(f"padded vocabulary {vocab[0]} -> {vocab[1]} (tokenizer {saved['tokenizer_vocab_size']}): "
                       f"padding rows the checkpoint lacks keep this run's initialisation, the loss moves "
                       f"by the padding logits' share")
    return ReshardPlan(saved, owners, index, same_partition, same_schedule, load_optimizer,
                       tuple(notices), holders, same_tp, vocab)


def _notices(saved: dict[str, Any], ours: dict[str, Any], same_ranks: bool, same_schedule: bool,
             metadata: dict[str, Any]) -> list[str]:
    """One line per piece of state that is reset rather than carried (``same_ranks``: the same
    stage partition and TP size, so every rank has its old twin)."""
    notices = [f"resharding the checkpoint from {describe(saved)} to {describe(ours)}"]
    if not same_ranks:
        changed = "stage partition" if partition(saved) != partition(ours) else "tensor-parallel size"
        notices.append(f"{changed} changed: dropout RNG streams restart from --seed, "
                       "drift histograms start empty")
    policies = {signature["pipeline_schedule"] for signature in (saved, ours)
                if (policy := schedule_policy(signature)) is not None and policy.weight_policy_has_state}
    if policies and not (same_ranks and same_schedule):
        notices.append(f"weight-version state of {'/'.join(sorted(policies))} reset (2BW's stash, "
                       f"PipeMare's delta start fresh)")
    state = metadata.get("schedule_state")
    if state is not None and not is_rebuild_decision(state) and not (same_ranks and same_schedule):
        notices.append("the schedule's profiled order is not carried over (profiled again)")
    return notices


def merge_optimizer_states(states: list[tuple[dict[str, Any], set[str], set[str]]]) -> dict[str, Any]:
    """One optimizer ``state_dict`` out of several old files'.

    ``states`` holds per old file its state dict, the parameter names the file held, and the
    names to take from it (each name from one file). A dict-valued entry keyed by parameter
    names (AdamW's ``params``, basis rotation's ``rotation``) is merged; anything else
    (``step_count``, ``rotation_config``) is the same for all sources (checked by :func:`plan`
    for the count) and taken from the first. Tensor-parallel shards of AdamW's entries are
    assembled afterwards (:func:`megatron.trainer.checkpointing.checkpoint._load_resharded`).
    """
    merged: dict[str, Any] = {}
    for state, held, take in states:
        for key, value in state.items():
            if isinstance(value, dict) and set(value) <= held:
                merged.setdefault(key, {}).update({n: v for n, v in value.items() if n in take})
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
