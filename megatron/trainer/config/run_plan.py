"""The run plan: what a run derives from its config and its host, decided once, before any rank starts.

:class:`~megatron.trainer.config.job_config.JobConfig` is what the user asked for. Everything
that follows from it and from the machine is here: the schedule's config and the stage layout
(:class:`~megatron.trainer.config.run_config.RunConfig`), the global batch of every iteration,
the layer split and how it was decided, the padded vocabulary, whether the embeddings tie, the
per-rank memory estimate and the room it leaves, what this process's host set-up did, and, for
``auto``, the layouts it may rebuild the run in and the decision a rebuilt run was made by
(with the one codec that keeps that decision in checkpoints). The plan is frozen: a later
decision (``auto``'s memory limit, this rank's core binding) makes a new plan that its caller
passes on, so what a function read is what the run used.

Why its type lives on the config floor: every floor reads a plan (the models read the config's
sections, the checkpoints the layout and ``auto``'s decision), while only the floors above the
tasks can build one (:func:`megatron.trainer.plan.build.build_run_plan` needs the tokenizer,
the cost models and the checkpoint on disk).

A plan reads like its config: ``plan.model`` is ``plan.config.model``, for each section, so a
function reads what was asked and what was derived from the one object it is handed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron.pipeline.schedules import SELECTORS
from megatron.trainer.config.batch_plan import BatchPlan
from megatron.trainer.config.job_config import (
    CheckpointConfig, DataConfig, ExitConfig, JobConfig, LaunchConfig, LoggingConfig, ModelConfig, OptimizerConfig,
    ParallelConfig, PrecisionConfig, RecomputeConfig, ScheduleSettings, TaskOptions, TrainingConfig, replace_in)
from megatron.trainer.config.run_config import RunConfig
from megatron.trainer.config.values import JsonValue

if TYPE_CHECKING:
    from megatron.pipeline.costs.memory import MemoryEstimate
    from megatron.pipeline.schedules.base import Schedule


@dataclass(frozen=True)
class MemoryRoom:
    """The preflight memory check's estimate (the banner prints it) and what it left: bytes
    free after the estimate and the stages per device where it ran (``auto`` bounds its choice
    by them)."""

    estimate: MemoryEstimate
    room: tuple[int, int] | None = None


@dataclass(frozen=True)
class HostEffects:
    """What this process's host set-up did (:func:`megatron.trainer.launch.host.prepare_host`;
    the banner's words): the core binding and the host allocator policy."""

    core_binding: str | None = None
    host_malloc: str | None = None


@dataclass(frozen=True)
class Vocabulary:
    """The model's vocabulary (:func:`megatron.trainer.tokenizer.vocabulary.vocabulary`): the
    embedding's rows (the tokenizer's ids padded like Megatron-LM, else ``--vocab-size``), the
    tokenizer's own size (which rows are padding; None without a tokenizer) and NullTokenizer's
    id count (its EOD id is that size; None for other tokenizers)."""

    size: int
    tokenizer_size: int | None = None
    null_size: int | None = None


@dataclass(frozen=True)
class LayerSplit:
    """The layers of each stage, or of each model chunk of a chunked layout, and how they were
    decided (:func:`megatron.trainer.plan.partition.resolve_partition`; the banner says it).

    ``partition`` is what applies: ``explicit`` (``--pipeline-layer-split``, or Megatron-LM's
    split flags named in ``source``), ``checkpoint`` (the ``--load`` checkpoint's), ``balanced``,
    ``even`` or ``profiled`` (measured on the ranks before training, which then replace the
    counts). ``counts`` None: the even split. ``feasible``: the balanced split fits
    ``--pipeline-partition-memory-gb``; ``resumed``: a profiled run took its checkpoint's split."""

    counts: list[int] | None
    partition: str
    source: str | None = None
    feasible: bool = True
    resumed: bool = False


@dataclass(frozen=True)
class Embeddings:
    """Whether this run ties the output layer to the input embedding, and the banner's line
    saying why (:func:`megatron.trainer.config.tied_args.embeddings_of`: the schedule decides
    it, not the flag alone)."""

    tied: bool
    line: str


@dataclass(frozen=True)
class RunPlan:
    """The config and what was derived from it (module docstring)."""

    config: JobConfig
    #: the schedule class, its config (options from its flags) and the stage layout
    run: RunConfig
    #: the global batch of every iteration (constant without ``--rampup-batch-size``)
    batch: BatchPlan
    #: the layers of each stage (or model chunk), and how they were decided
    layers: LayerSplit
    #: the model's vocabulary (padded)
    vocab: Vocabulary
    #: whether the output layer is tied to the embedding, and why
    embeddings: Embeddings
    #: the preflight memory check's estimate and room (None where no check ran in this process)
    memory: MemoryRoom | None = None
    #: what this process's host set-up did (a rank's; empty before)
    host: HostEffects = HostEffects()
    #: ``auto``: the plans of the layouts it may rebuild the run in, by label
    #: (:mod:`megatron.trainer.loop.auto.candidates`)
    relayouts: dict[str, RunPlan] = field(default_factory=dict)
    #: a run ``auto`` rebuilt: its decision (:meth:`AutoSchedule.describe`), kept in checkpoints
    chosen_by: dict[str, JsonValue] | None = None

    # The config's sections, read through the plan.
    @property
    def model(self) -> ModelConfig:
        return self.config.model

    @property
    def parallel(self) -> ParallelConfig:
        return self.config.parallel

    @property
    def schedule(self) -> ScheduleSettings:
        return self.config.schedule

    @property
    def training(self) -> TrainingConfig:
        return self.config.training

    @property
    def optimizer(self) -> OptimizerConfig:
        return self.config.optimizer

    @property
    def precision(self) -> PrecisionConfig:
        return self.config.precision

    @property
    def recompute(self) -> RecomputeConfig:
        return self.config.recompute

    @property
    def data(self) -> DataConfig:
        return self.config.data

    @property
    def checkpoint(self) -> CheckpointConfig:
        return self.config.checkpoint

    @property
    def exit(self) -> ExitConfig:
        return self.config.exit

    @property
    def logging(self) -> LoggingConfig:
        return self.config.logging

    @property
    def launch(self) -> LaunchConfig:
        return self.config.launch

    @property
    def task(self) -> TaskOptions:
        return self.config.task

    @property
    def num_microbatches(self) -> int:
        return self.config.num_microbatches

    @property
    def num_model_chunks(self) -> int:
        return self.config.num_model_chunks

    def schedule_state(self, schedule: Schedule | None) -> dict[str, JsonValue] | None:
        """What this run's checkpoints keep of ``schedule``: what it decided during the run and
        must keep on resume (zb-1p/zb-2p's profiled costs), or None (also without a schedule: a
        save before any training segment). In a run ``auto`` rebuilt in another layout, its
        decision (``chosen_by``) with the schedule's own state as ``inner``, so a resumed
        ``auto`` run keeps the layout (:func:`restore_schedule_state` unwraps it)."""
        own = None if schedule is None else schedule.policy.checkpoint.save()
        return own if self.chosen_by is None else {**self.chosen_by, "inner": own}

    def replace_in(self, section: str, **values: Any) -> RunPlan:
        """A plan whose config has fields of one section replaced
        (``plan.replace_in("checkpoint", load=path)``, a profiled layer split); the derived parts
        stay as they are."""
        return dataclasses.replace(self, config=replace_in(self.config, section, **values))

    def with_schedule_options(self, **options: Any) -> RunPlan:
        """A plan whose schedule config has the fields ``options`` of its options dataclass set
        (a launch-time decision for ``auto``; a field the schedule's options lack is a TypeError)."""
        schedule = self.run.schedule
        schedule = dataclasses.replace(schedule, options=dataclasses.replace(schedule.options, **options))
        return dataclasses.replace(self, run=dataclasses.replace(self.run, schedule=schedule))


def restore_schedule_state(schedule: Schedule, state: dict[str, JsonValue] | None) -> None:
    """Hand a checkpoint's :meth:`RunPlan.schedule_state` back to the resumed run's schedule. A
    schedule that decides nothing at run time ignores it (e.g. zb-2p resumed with
    ``--zb-costs``: the user fixed the order on purpose); a schedule rebuilt by ``auto``'s
    decision takes the decision's ``inner`` state (none: the run had not trained in it yet)."""
    if state is None:
        return
    if is_rebuild_decision(state) and schedule.name not in SELECTORS:
        inner = state.get("inner")  # the rebuilt schedule's own state
        if isinstance(inner, dict):
            schedule.policy.checkpoint.restore(inner)
        return
    schedule.policy.checkpoint.restore(state)


def is_rebuild_decision(state: dict[str, JsonValue]) -> bool:
    """Whether a checkpoint's schedule state is ``auto``'s decision to rebuild the stages in
    another layout (the rebuilt schedule's own state, if any, inside as ``inner``)."""
    return bool(state.get("relayout"))
