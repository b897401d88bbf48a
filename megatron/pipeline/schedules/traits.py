"""What a schedule class declares once, readable without building it (:class:`ScheduleTraits`).

The trainer's parser, its flag checks, the planner and the checkpoint reshard ask a schedule
*class* what it is (asynchronous, how many chunks, which flags, which options type, its policy
for a config) before any schedule exists; one frozen record per class holds the answers, so
the :class:`~megatron.pipeline.schedules.base.Schedule` class itself stays small.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron.pipeline.ir import PipelineLayout
from megatron.pipeline.schedules.config import ScheduleConfig, ScheduleOptions
from megatron.pipeline.schedules.options import FlagGroup
from megatron.pipeline.schedules.policy import SchedulePolicy

if TYPE_CHECKING:
    PolicyBuilder = Callable[[ScheduleConfig], SchedulePolicy]


def plain_policy(config: ScheduleConfig) -> SchedulePolicy:
    """The policy of a schedule that adds nothing: one chain of virtual stages, live weights
    (one copy), the run's learning rate, no sharding, nothing checkpointed."""
    return SchedulePolicy.plain(config.layout)


@dataclass(frozen=True)
class ScheduleTraits:
    """A schedule class's static declarations.

    ``asynchronous``: stages step locally (no pipeline-wide optimizer step). ``takes_model_chunks``:
    a stage may hold several model chunks (``--num-layers-per-virtual-pipeline-stage``).
    ``flag_groups``: the command-line flags it takes (groups shared by several schedules are
    declared once). ``options``: its options dataclass, deriving from the options of each of its
    groups. ``flag_defaults``: its defaults, by ``dest``, for shared flags that default
    differently here (zb-v does not profile unless asked). ``drift_bounded``: an asynchronous
    schedule's weight-version drift has a declared bound (every registered one does: PACI's
    ``ceil((N-1-s)/a)``, AMDP's one step, 2BW's stash, PipeMare's PACI bound); the planner
    calls a schedule without one ``unbounded``. ``may_become_asynchronous``: a selector that may
    switch the run to an asynchronous schedule (``auto-async``), so it is treated as one where
    that decides something up front (untied embeddings). ``policy_for``: its policy for a
    config (layout, weights, learning rate, sharding, ...; :class:`SchedulePolicy`), what the
    trainer needs before a schedule is built; an instance adds what it decides at run time
    (``Schedule.policy``).
    """

    asynchronous: bool = False
    takes_model_chunks: bool = False
    flag_groups: tuple[FlagGroup, ...] = ()
    options: type[ScheduleOptions] = ScheduleOptions
    flag_defaults: tuple[tuple[str, Any], ...] = ()
    drift_bounded: bool = True
    may_become_asynchronous: bool = False
    policy_for: PolicyBuilder = plain_policy

    def options_from_flags(self, values: Mapping[str, Any], config: ScheduleConfig) -> ScheduleOptions:
        """The schedule's options from the values of its flags (by ``dest``); ``config`` is the
        run's config without options. Raises :class:`ScheduleConfigError` (one line)."""
        given = {**values, **{dest: value for dest, value in self.flag_defaults if values.get(dest) is None}}
        fields: dict[str, Any] = {}
        for group in self.flag_groups:
            fields.update(group.to_options(given, config))
        return self.options(**fields)

    def layout_of(self, config: ScheduleConfig) -> PipelineLayout:
        """Where the schedule puts model chunks for ``config`` (the trainer builds stages from it)."""
        return self.policy_for(config).layout
