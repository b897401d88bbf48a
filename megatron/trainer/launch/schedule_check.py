"""``--no-schedule-check`` and the up-front refusal of a schedule that cannot run.

Why: a schedule whose streams deadlock or send a message its peer does not expect next hangs
every rank of a live run until ``--pipeline-timeout-seconds`` (300 s by default) and then names
no op. :func:`megatron.pipeline.preflight.replay_first_iterations` replays the run's first
iterations, across a segment boundary, through the schedule check in this process before
any rank starts (the local launcher, the emulator, a single-rank run, and under torchrun or
Slurm each rank before its process group exists), and the fault is refused with one ``error:``
line naming the stage and the op.

The replay is bounded (``N (N + m)`` ops), about a second for 32 stages and 64 micro-batches
(``docs/benchmarks.md``); ``--no-schedule-check`` skips it for configurations where even that
is too slow. Ranks our own launcher started skip it: the launcher checked before starting them.
"""
from __future__ import annotations

import os

from megatron.trainer.config.errors import ConfigError
from megatron.pipeline.preflight import PreflightReplay, replay_first_iterations
from megatron.pipeline.replay import ScheduleError
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.environment import LAUNCHED_ENV


def check_schedule(config: RunPlan) -> PreflightReplay | None:
    """Replay the run's schedule (module docstring); None where this process does not check.
    Raises :class:`ConfigError`."""
    if not config.schedule.schedule_check or os.environ.get(LAUNCHED_ENV):
        return None
    schedule = config.run.run_schedule(config.schedule.pipeline_schedule)
    try:
        return replay_first_iterations(schedule)
    except ScheduleError as exc:
        raise ConfigError(f"--pipeline-schedule {config.schedule.pipeline_schedule}: the schedule cannot run "
                          f"its first iterations: {exc}") from None
