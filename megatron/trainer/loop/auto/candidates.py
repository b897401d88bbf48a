"""The layouts an ``auto`` run may rebuild its stages in (the candidates of
:func:`~megatron.pipeline.planner.decide.decide` beside its own chain), decided before any rank starts.

Why before: a rank holds only the configuration it was handed, not the command line, and
every rank must rebuild into the same layout. So before any rank starts the trainer derives,
from the user's own flags (the parsed namespace, before any check derived from it:
:func:`megatron.trainer.launch.preflight.check_launch`), the configuration of each synchronous
schedule that needs another placement than the chain the run starts on (the V schedules;
interleaving at each chunk count the layers divide into), keeps those whose flags pass every
check (the same checks, on a copy of the namespace: no argv parsed again, no output
swallowed), and hands them to the run (the run plan's ``relayouts``); ``auto`` ranks them
with the profiled costs (:mod:`megatron.pipeline.planner.relayout`) and, if one wins, the
trainer rebuilds in it at the drained decision boundary (:mod:`.rebuild`).

Flags of ``auto``'s own groups that the rebuilt schedule does not take (``--zb-profile-iters``,
``--zb-memory-limit``, ...) are back at their defaults in its flags: they configured the
choice, not the schedule chosen.

The choice is kept: a run resumed from a checkpoint whose ``auto`` rebuilt (or decided to)
starts in the chosen layout straight away (:func:`resume_in_chosen_layout`), and so does a
run whose ``auto`` decides from fixed costs (``--zb-costs``) at its start.

Under a memory limit (``--zb-memory-limit``, the device's) a rebuilt layout is held to it in
the chain's units: each layout's activation bytes per part come from the planner's analytic
model (:func:`~megatron.pipeline.costs.stages.part_sizes`), the chain's too, and a stage's
peak is compared in its chain stage's ``M_B``.

Not offered: a layout whose flags derive another model (its checkpoint signature differs, and
the rebuild could not load; the V layouts now tie under ``--overlap-grad-reduce`` and the
distributed optimizer as the chain does, so they are offered there), over several nodes without ``--save`` (the rebuild goes through a checkpoint
every rank must read), with a batch-size rampup, and to ``auto-async`` (only synchronous
layouts are rebuilt: the numbers stay those of the chain).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from megatron.pipeline.planner.auto_schedule import AutoSchedule, auto_options
from megatron.pipeline.planner.candidates import chunk_counts
from megatron.pipeline.costs.op_costs import OpCosts
from megatron.pipeline.planner.relayout import Relayout, relayout_stage_costs
from megatron.pipeline.schedules.zero_bubble.flags import profile_iterations
from megatron.pipeline.planner.runtime_choice import switchable
from megatron.pipeline.costs.stages import part_sizes
from megatron.pipeline.schedules import SCHEDULES, schedule_class
from megatron.pipeline.schedules.base import Schedule
from megatron.trainer.checkpointing.checkpoint import check_resume
from megatron.trainer.checkpointing.format import _read_metadata, run_signature
from megatron.trainer.checkpointing.reshard import LAYOUT_FLAGS
from megatron.trainer.plan.parse import check_args
from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.plan.memory_estimate import part_layer_counts
from megatron.trainer.tasks.balanced_partition import model_shape
from megatron.trainer.tasks.task import PretrainTask


def without_flags(flags: argparse.Namespace, schedule: str, target: str) -> argparse.Namespace:
    """A copy of the user's ``flags`` with every flag of ``schedule``'s groups that ``target``
    does not take back at its default (as if not given)."""
    kept_groups = set(schedule_class(target).traits.flag_groups)
    out = copy.deepcopy(flags)
    for group in schedule_class(schedule).traits.flag_groups:
        if group not in kept_groups:
            for flag in group.flags:
                setattr(out, flag.dest, flag.default_value)
    return out


def layout_flags(flags: argparse.Namespace, auto: str, name: str, chunks: int) -> argparse.Namespace:
    """The user's ``flags`` for schedule ``name`` at ``chunks`` model parts per stage instead
    of ``auto`` (the layers per virtual stage, where the schedule takes chunks)."""
    out = without_flags(flags, auto, name)
    out.pipeline_schedule = name
    if schedule_class(name).traits.takes_model_chunks:
        out.num_layers_per_virtual_pipeline_stage = flags.num_layers // (flags.pipeline_model_parallel_size * chunks)
    return out


def checked_plan(flags: argparse.Namespace) -> RunPlan | None:
    """The run plan of ``flags`` (derived and checked as the run's own were), or None where a
    check refuses them (that layout is not offered)."""
    try:
        return check_args(flags)
    except ConfigError:
        return None


def _part_layers(config: RunPlan) -> tuple[int, ...]:
    layout = config.run.layout
    split = layout.part_layer_split(config.layers.counts)
    return tuple(split) if split is not None else tuple(part_layer_counts(config, layout.num_model_stages))


def _same_model(task: PretrainTask, config: RunPlan, alt: RunPlan) -> bool:
    """Whether ``alt`` runs the model ``config`` does (every checkpoint signature entry but the
    layout's): the flags derive some of it from the schedule (whether the embeddings tie), and
    the rebuild's checkpoint must load."""
    ours, theirs = run_signature(task, config), run_signature(task, alt)
    return all(theirs.get(key) == value for key, value in ours.items() if key not in LAYOUT_FLAGS)


def relayout_configs(task: PretrainTask, config: RunPlan, flags: argparse.Namespace) -> dict[str, RunPlan]:
    """Each rebuildable layout's job config by its label (``dualpipev x2``), ``flags`` being the
    user's flags as parsed (:func:`~megatron.trainer.launch.preflight.check_launch`) ``config`` came from."""
    auto = config.schedule.pipeline_schedule
    stages, layers = config.parallel.pipeline_model_parallel_size, config.model.num_layers
    out: dict[str, RunPlan] = {}
    for name, cls in SCHEDULES.items():
        if cls.traits.asynchronous or switchable(name, config.run.schedule, include_async=False):
            continue
        for chunks in chunk_counts(name, layers, stages) if cls.traits.takes_model_chunks else [2]:
            alt = checked_plan(layout_flags(flags, auto, name, chunks))
            if alt is None or alt.run.layout.num_chunks != chunks or not _same_model(task, config, alt):
                continue
            out[relayout_of(alt).label] = alt
    return out


def _activation_bytes(config: RunPlan, counts: Sequence[int]) -> tuple[float, ...]:
    """One micro-batch's activation bytes on each of the parts holding ``counts`` layers
    (the planner's analytic model); () for a task without transformer layers."""
    shape = model_shape(config)
    if shape is None:
        return ()
    return tuple(p.activation_bytes for p in part_sizes(shape, counts, config.parallel.tensor_model_parallel_size))


def relayout_of(alt: RunPlan) -> Relayout:
    """What ``auto`` ranks of a rebuildable layout: its schedule, chunks, layers per part, the
    options its flags give (its op order) and its parts' activation bytes."""
    parts = _part_layers(alt)
    return Relayout(alt.schedule.pipeline_schedule, alt.run.layout.num_chunks, parts,
                    alt.run.schedule.options, _activation_bytes(alt, parts))


def offers_relayouts(config: RunPlan) -> bool:
    """Whether an ``auto`` run may rebuild (module docstring: not ``auto-async``, not with a
    batch-size rampup, on several nodes only with ``--save``)."""
    run = config.run
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    one_node = local is None or local == world
    return (issubclass(run.schedule_cls, AutoSchedule) and not run.schedule_cls.include_async
            and run.layout.num_chunks == 1 and config.training.rampup_batch_size is None
            and (one_node or config.checkpoint.save is not None))


def apply_auto_relayouts(task: PretrainTask, config: RunPlan, flags: argparse.Namespace) -> RunPlan:
    """Hand an ``auto`` run the layouts it may rebuild in (schedule options for the choice, the
    job configs for the rebuild): the config with them."""
    if not offers_relayouts(config):
        return config
    alts = relayout_configs(task, config, flags)
    if not alts:
        return config
    chain = tuple(part_layer_counts(config, config.parallel.pipeline_model_parallel_size))
    config = config.with_schedule_options(relayouts=tuple(relayout_of(a) for a in alts.values()),
                                          stage_layers=chain, stage_activation_bytes=_activation_bytes(config, chain))
    return dataclasses.replace(config, relayouts=alts)


def chosen_config(config: RunPlan, decision: dict[str, Any]) -> RunPlan:
    """The job config ``auto``'s ``decision`` (:meth:`AutoSchedule.describe`) rebuilds the run
    in, marked with the decision (its checkpoints keep it), with ``config``'s launch, logging,
    exit and checkpoint settings; KeyError where this run offers no such layout."""
    alt = config.relayouts[decision["relayout"]]
    if profile_iterations(alt.run.schedule.options):  # zb-v: ordered by the costs auto ranked it with
        priced = priced_costs(config, decision)
        alt = alt.with_schedule_options(profile_iters=0, costs=priced)
    asked = dataclasses.replace(alt.config, checkpoint=config.checkpoint, logging=config.logging, exit=config.exit,
                                launch=config.launch)
    return dataclasses.replace(alt, config=asked, chosen_by=decision, memory=config.memory, host=config.host)


def priced_costs(config: RunPlan, decision: dict[str, Any]) -> tuple[OpCosts, ...]:
    """The per-stage costs ``auto`` ranked the chosen layout with, priced from the chain's
    profiled costs in ``decision`` (what a cost-ordered schedule is then ordered by, instead of
    profiling again)."""
    options = auto_options(config.run.schedule.options)
    relayout = next(r for r in options.relayouts if r.label == decision["relayout"])
    chain = tuple(OpCosts.from_dict(c) for c in decision["costs"])
    run = config.run.schedule
    return tuple(relayout_stage_costs(relayout, run.num_stages, run.num_microbatches, chain,
                                      options.stage_layers)[2])


def chosen_relayout(schedule: Schedule | None) -> dict[str, Any] | None:
    """``auto``'s decision (its policy's checkpoint state, :meth:`AutoSchedule.checkpoint_state`) when it chose to rebuild."""
    if isinstance(schedule, AutoSchedule) and schedule.relayout is not None:
        return schedule.policy.checkpoint.save()
    return None


def _saved_decision(task: PretrainTask, config: RunPlan) -> dict[str, Any] | None:
    """The schedule state of the checkpoint ``--load`` resumes from, as saved (a resumed run of
    another layout drops it: the rebuilt layout's checkpoint still carries ``auto``'s decision)."""
    if not config.checkpoint.load or config.checkpoint.finetune:
        return None
    point = check_resume(task, config, verify_files=False)
    if point is None:
        return None
    state = _read_metadata(point.directory).get("schedule_state")
    return state if isinstance(state, dict) else None


def start_in_chosen_layout(task: PretrainTask, config: RunPlan) -> RunPlan:
    """An ``auto`` run that decided to rebuild before training: in the checkpoint it resumes
    from, or from fixed costs (``--zb-costs``) at its start; the config of the chosen layout
    (unchanged otherwise). A choice this run does not offer: one-line :class:`ConfigError`."""
    if not config.relayouts:
        return config
    saved = _saved_decision(task, config)
    auto = config.run.run_schedule(config.schedule.pipeline_schedule)
    if saved is not None and saved.get("relayout"):
        decision: dict[str, Any] | None = {k: v for k, v in saved.items() if k != "inner"}
        lines = [f"auto: resuming as {decision['relayout']}, the layout the checkpoint's run chose and rebuilt in"]
    else:
        decision = chosen_relayout(auto)
        lines = auto.decision_lines() if decision is not None else []  # type: ignore[attr-defined]
    if decision is None:
        return config
    if decision["relayout"] not in config.relayouts:
        raise ConfigError(f"--pipeline-schedule {config.schedule.pipeline_schedule}: the decision to rebuild the stages "
                          f"as {decision['relayout']} cannot run with these flags")
    if os.environ.get("RANK", "0") == "0":
        for line in lines:
            print(f"[megatron-async] {line}", flush=True)
    return chosen_config(config, decision)
