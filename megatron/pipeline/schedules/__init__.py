"""Schedule registry: ``--pipeline-schedule NAME`` looks schedules up here."""
from __future__ import annotations

from megatron.pipeline.schedules.base import (
    Schedule,
    ScheduleConfig,
    ScheduleConfigError,
    SynchronousSchedule,
    AsynchronousSchedule,
)
from megatron.pipeline.schedules.gpipe import GPipe
from megatron.pipeline.schedules.one_f_one_b import OneFOneBFlush
from megatron.pipeline.schedules.paci import PACI, Async1F1B

SCHEDULES: dict[str, type[Schedule]] = {cls.name: cls for cls in (OneFOneBFlush, GPipe, PACI, Async1F1B)}


def register(cls: type[Schedule]) -> type[Schedule]:
    """Add a schedule class to the registry (usable as a decorator)."""
    SCHEDULES[cls.name] = cls
    return cls


def schedule_class(name: str) -> type[Schedule]:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ScheduleConfigError(
            f"unknown pipeline schedule {name!r}; choose from {', '.join(sorted(SCHEDULES))}"
        ) from None


def build_schedule(name: str, config: ScheduleConfig) -> Schedule:
    return schedule_class(name)(config)


__all__ = [
    "SCHEDULES",
    "Schedule",
    "ScheduleConfig",
    "ScheduleConfigError",
    "SynchronousSchedule",
    "AsynchronousSchedule",
    "build_schedule",
    "register",
    "schedule_class",
]
