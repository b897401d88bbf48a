"""Schedule registry: ``--pipeline-schedule NAME`` looks schedules up here.

Adding a schedule is one module and one line here (``docs/adding_a_schedule.md``): the trainer
reads a schedule's flags, checks and policies from its class, never from its name.
"""
from __future__ import annotations

from megatron.pipeline.schedules.base import (
    Schedule,
    ScheduleConfig,
    ScheduleConfigError,
    SynchronousSchedule,
    AsynchronousSchedule,
)
from megatron.pipeline.schedules.sync.gpipe import GPipe
from megatron.pipeline.schedules.sync.one_f_one_b import OneFOneBFlush
from megatron.pipeline.schedules.asynchronous.amdp import AMDP
from megatron.pipeline.schedules.v_shape.dualpipev import DualPipeV
from megatron.pipeline.schedules.v_shape.v_half import VHalf
from megatron.pipeline.schedules.v_shape.v_min import VMin
from megatron.pipeline.schedules.v_shape.zb_v import ZBV
from megatron.pipeline.schedules.options import Flag, FlagGroup
from megatron.pipeline.schedules.zero_bubble.profiled import ProfiledSchedule
from megatron.pipeline.schedules.zero_bubble.flags import profile_iterations
from megatron.pipeline.schedules.config import ScheduleOptions
from megatron.pipeline.schedules.policy import SchedulePolicy
from megatron.pipeline.schedules.traits import ScheduleTraits
from megatron.pipeline.schedules.asynchronous.paci import PACI, Async1F1B
from megatron.pipeline.schedules.asynchronous.pipedream_2bw import PipeDream2BW
from megatron.pipeline.schedules.asynchronous.pipemare import PipeMare
from megatron.pipeline.schedules.sync.interleaved import Interleaved1F1B
from megatron.pipeline.schedules.zero_bubble.zb_1p import ZB1P
from megatron.pipeline.schedules.zero_bubble.zb_2p import ZB2P
from megatron.pipeline.schedules.zero_bubble.zb_h1 import ZBH1
from megatron.pipeline.schedules.zero_bubble.zb_h2 import ZBH2

SCHEDULES: dict[str, type[Schedule]] = {cls.name: cls for cls in (OneFOneBFlush, GPipe, PACI, Async1F1B)}
SCHEDULES[Interleaved1F1B.name] = Interleaved1F1B  # Megatron-LM virtual pipeline stages
SCHEDULES.update({cls.name: cls for cls in (ZBH1, ZBH2, ZB1P, ZB2P)})  # Zero Bubble (Qi et al.)
SCHEDULES[PipeDream2BW.name] = PipeDream2BW  # double-buffered weights (Narayanan et al.)
SCHEDULES[PipeMare.name] = PipeMare  # T1 lr rescheduling, T2 discrepancy correction (Yang et al.)
SCHEDULES[AMDP.name] = AMDP  # D/2 replicated pipelines in alternating directions
SCHEDULES.update({cls.name: cls for cls in (ZBV, VHalf, VMin, DualPipeV)})  # V placement (Qi et al. 2024; DualPipe)

#: schedules that choose one of :data:`SCHEDULES` while running (``auto``, ``auto-async``:
#: :mod:`megatron.pipeline.planner.auto_schedule` registers them; not candidates themselves)
SELECTORS: dict[str, type[Schedule]] = {}

#: ``--pipeline-schedule``'s default
DEFAULT_SCHEDULE = OneFOneBFlush.name


def register(cls: type[Schedule]) -> type[Schedule]:
    """Add a schedule class to the registry (usable as a decorator)."""
    SCHEDULES[cls.name] = cls
    return cls


def register_selector(cls: type[Schedule]) -> type[Schedule]:
    """Add a selector (see :data:`SELECTORS`)."""
    SELECTORS[cls.name] = cls
    return cls


def schedule_class(name: str) -> type[Schedule]:
    """A registered schedule or a selector (``auto``, ``auto-async``: not in :data:`SCHEDULES`,
    which lists what they choose from), or ``torch-csv:PATH`` (an order in torch's compute-only
    CSV, :mod:`.imported.torch_csv`)."""
    if name.startswith("torch-csv:"):  # an order exported by torch.distributed.pipelining (issue #44)
        from megatron.pipeline.schedules.imported.torch_csv import torch_csv_class
        return torch_csv_class(name)
    try:
        return SCHEDULES[name] if name in SCHEDULES else SELECTORS[name]
    except KeyError:
        raise ScheduleConfigError(
            f"unknown pipeline schedule {name!r}; choose from {', '.join(sorted([*SCHEDULES, *SELECTORS]))}"
        ) from None


def build_schedule(name: str, config: ScheduleConfig) -> Schedule:
    """The schedule ``name`` for ``config``; with ``ZeroBubbleOptions.profile_iters = K > 0``
    (zb-1p / zb-2p / zb-v) a :class:`~.profiled.ProfiledSchedule` that decides its order from
    costs profiled during the first K iterations."""
    cls = schedule_class(name)
    if profile_iterations(config.options) and name not in SELECTORS:  # a selector profiles by itself
        return ProfiledSchedule(cls, config)
    return cls(config)


def flag_groups() -> dict[FlagGroup, list[str]]:
    """Every flag group of a registered schedule, once, in registry order -> the names of the
    schedules that take it (the trainer's parser and its refusals are built from this)."""
    groups: dict[FlagGroup, list[str]] = {}
    for name, cls in SCHEDULES.items():
        for group in cls.traits.flag_groups:
            groups.setdefault(group, []).append(name)
    return groups


def chunked_schedules() -> list[str]:
    """Names of the registered schedules that run several model chunks per stage."""
    return [name for name, cls in SCHEDULES.items() if cls.traits.takes_model_chunks]


__all__ = [
    "DEFAULT_SCHEDULE",
    "SCHEDULES",
    "Flag",
    "FlagGroup",
    "Schedule",
    "ScheduleConfig",
    "ScheduleConfigError",
    "ScheduleOptions",
    "SchedulePolicy",
    "ScheduleTraits",
    "SynchronousSchedule",
    "AsynchronousSchedule",
    "build_schedule",
    "chunked_schedules",
    "flag_groups",
    "register",
    "schedule_class",
]
