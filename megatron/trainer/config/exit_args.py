"""Flags for a graceful early exit (Megatron-LM's names): on a signal, or after a wall time.

``--exit-signal-handler``: on ``--exit-signal`` (SIGTERM, as Megatron-LM; SIGUSR1 for Slurm's
``--signal=USR1@120``) every rank finishes its work up to the next stop check, the run
saves a checkpoint and exits 0. ``--exit-duration-in-mins``: the same once the run has lasted
that long (rank 0's clock decides for every rank). Both need ``--save``: a stop that loses
the work is what they exist to avoid.

Stops happen where the whole pipeline is drained, i.e. at the end of a training segment
(:mod:`megatron.trainer.loop.segments`). Synchronous schedules drain every iteration, so they check
after every iteration by default and extra boundaries change no number. An asynchronous
schedule drains only at segment ends (``--save-interval``, ``--eval-interval``), so it needs one
of those or ``--exit-check-interval N`` (which adds a drain every N iterations: a flush that
changes its numbers exactly as a save interval would).
"""
from __future__ import annotations

import argparse
import signal

from megatron.trainer.config.errors import ConfigError
from megatron.pipeline.schedules import SCHEDULES, schedule_class
from megatron.trainer.config.job_config import JobConfig


EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")


def add_exit_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("graceful exit")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal: finish the current iteration, save a checkpoint (--save) and exit 0")
    g.add_argument("--exit-signal", choices=EXIT_SIGNALS, default=None,
                   help="the signal --exit-signal-handler catches (default SIGTERM; SIGUSR1 for Slurm's --signal=USR1@T)")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save a checkpoint and exit once the run has lasted this many minutes")
    g.add_argument("--exit-check-interval", type=int, default=None, metavar="N",
                   help="check for a stop every N iterations (default: every iteration for synchronous "
                        "schedules; an asynchronous schedule checks at --save-interval/--eval-interval "
                        "boundaries, and this adds a pipeline drain every N iterations)")


def exit_signal(config: JobConfig) -> signal.Signals | None:
    """The signal that asks this run to save and stop (None without ``--exit-signal-handler``)."""
    if not config.exit.exit_signal_handler:
        return None
    return signal.Signals[config.exit.exit_signal or "SIGTERM"]


def stops_early(config: JobConfig) -> bool:
    """Whether the run checks for a graceful stop between segments."""
    return bool(config.exit.exit_signal_handler) or config.exit.exit_duration_in_mins is not None


def exit_check_every(config: JobConfig) -> int | None:
    """Iterations between stop checks (extra segment boundaries; None: no check): every
    ``--exit-check-interval``, else every iteration of a synchronous schedule, else none but
    the boundaries the run has anyway (an asynchronous pipeline stops only where it drains)."""
    if not stops_early(config):
        return None
    if config.exit.exit_check_interval is not None:
        return config.exit.exit_check_interval
    return None if schedule_class(config.schedule.pipeline_schedule).traits.asynchronous else 1


def check_exit_flags(args: argparse.Namespace) -> None:
    """Check the exit flags (raise :class:`ConfigError`, one line)."""
    schedule = SCHEDULES.get(args.pipeline_schedule)  # an unknown name is reported later
    asynchronous = schedule is not None and schedule.traits.asynchronous
    if args.exit_signal is not None and not args.exit_signal_handler:
        raise ConfigError("--exit-signal needs --exit-signal-handler")
    # Ranges (finite, > 0, >= 1) are flag_checks.DOMAINS' job, checked before this.
    if not (args.exit_signal_handler or args.exit_duration_in_mins is not None):  # stops_early
        if args.exit_check_interval is not None:
            raise ConfigError("--exit-check-interval needs --exit-signal-handler or --exit-duration-in-mins")
        return
    which = "--exit-signal-handler" if args.exit_signal_handler else "--exit-duration-in-mins"
    if args.save is None:
        raise ConfigError(f"{which} needs --save DIR: the stop saves a checkpoint to resume from")
    if args.exit_check_interval is None and asynchronous and args.save_interval is None \
            and args.eval_interval is None:
        raise ConfigError(
            f"{which} with the asynchronous schedule {args.pipeline_schedule} needs --save-interval, "
            f"--eval-interval or --exit-check-interval: it can only stop where its pipeline drains")
