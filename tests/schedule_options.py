"""Typed schedule options for tests that set them field by field (what the options dict's keys were)."""
from __future__ import annotations

from typing import Any

from megatron.pipeline.schedules import ScheduleOptions, schedule_class


def options_for(name: str, **fields: Any) -> ScheduleOptions:
    """Schedule ``name``'s options dataclass with ``fields`` set (TypeError for a field it lacks)."""
    return schedule_class(name).traits.options(**fields)
