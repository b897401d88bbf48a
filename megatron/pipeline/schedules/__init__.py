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
from megatron.pipeline.schedules.amdp import AMDP
from megatron.pipeline.schedules.paci import PACI, Async1F1B
from megatron.pipeline.schedules.pipedream_2bw import PipeDream2BW
from megatron.pipeline.schedules.pipemare import PipeMare
from megatron.pipeline.schedules.interleaved import Interleaved1F1B
from megatron.pipeline.schedules.zb_1p import ZB1P
from megatron.pipeline.schedules.zb_2p import ZB2P
from megatron.pipeline.schedules.zb_h1 import ZBH1
from megatron.pipeline.schedules.zb_h2 import ZBH2

SCHEDULES: dict[str, type[Schedule]] = {cls.name: cls for cls in (OneFOneBFlush, GPipe, PACI, Async1F1B)}
SCHEDULES[Interleaved1F1B.name] = Interleaved1F1B  # Megatron-LM virtual pipeline stages
SCHEDULES.update({cls.name: cls for cls in (ZBH1, ZBH2, ZB1P, ZB2P)})  # Zero Bubble (Qi et al.)
SCHEDULES[PipeDream2BW.name] = PipeDream2BW  # double-buffered weights (Narayanan et al.)
SCHEDULES[PipeMare.name] = PipeMare  # T1 lr rescheduling, T2 discrepancy correction (Yang et al.)
SCHEDULES[AMDP.name] = AMDP  # D/2 replicated pipelines in alternating directions


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
    """The schedule ``name`` for ``config``; with ``options["profile_iters"] = K > 0`` (zb-1p /
    zb-2p) a :class:`~.profiled.ProfiledSchedule` that decides its order from costs profiled
    during the first K iterations."""
    cls = schedule_class(name)
    if config.options.get("profile_iters"):
        from megatron.pipeline.schedules.profiled import ProfiledSchedule

        return ProfiledSchedule(cls, config)
    return cls(config)


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
