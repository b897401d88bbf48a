"""The rank side of a graceful stop: the exit signal's handler and the agreed stop decision.

A rank must never stop alone (its peers would wait on it until the pipeline timeout), so
the decision is taken at segment ends, where nothing is in flight, by one tiny MAX
all-reduce over every rank: any rank that caught the signal, or rank 0 once the wall time
is up, stops all of them at the same iteration.
"""
from __future__ import annotations

import signal
import time
from collections.abc import Callable

from megatron.trainer.config.exit_args import exit_signal, stops_early
from megatron.trainer.config.run_plan import RunPlan

PROCESS_START = time.monotonic()  # --exit-duration-in-mins counts from the program's start

Agree = Callable[[list[float]], list[float]]  # element-wise MAX over every rank


class StopControl:
    """Callable ``(iteration) -> reason | None``; the same answer on every rank."""

    def __init__(self, config: RunPlan, decides_time: bool, agree: Agree | None = None):
        self.signal = exit_signal(config)
        self.caught = False
        minutes = config.exit.exit_duration_in_mins
        self.deadline = PROCESS_START + 60.0 * minutes if minutes is not None and decides_time else None
        self.agree = agree
        self._previous = signal.signal(self.signal, self._catch) if self.signal is not None else None

    def restore(self) -> None:
        """Put the exit signal's previous handler back (a run inside a longer-lived process)."""
        if self.signal is not None:
            signal.signal(self.signal, self._previous)

    def _catch(self, _signum: int, _frame: object) -> None:
        self.caught = True  # repeated deliveries (Slurm, then torchrun forwarding) change nothing

    def __call__(self, iteration: int) -> str | None:
        flags = [float(self.caught), float(self.deadline is not None and time.monotonic() > self.deadline)]
        if self.agree is not None:
            flags = self.agree(flags)
        if flags[0] and self.signal is not None:  # every rank has the same flags, so the same signal
            return f"got {self.signal.name} (--exit-signal-handler)"
        if flags[1]:
            return "--exit-duration-in-mins reached"
        return None


def stop_control(config: RunPlan, decides_time: bool, agree: Agree | None = None) -> StopControl | None:
    """The run's stop check, or None when neither exit flag is given."""
    return StopControl(config, decides_time, agree) if stops_early(config) else None


class Terminated(Exception):
    """SIGTERM reached a rank that does not take it as its ``--exit-signal``.

    torchrun ends the surviving ranks with SIGTERM as soon as one rank dies, often before
    their own receive from the dead peer has failed. Raised from the handler in the main
    thread, it unwinds through the executor, which adds the stage and the op the rank was
    at, so every survivor still says where it stood instead of vanishing without a word."""


def _raise_terminated(signum: int, _frame: object) -> None:
    signal.signal(signum, signal.SIG_DFL)  # a second delivery ends the process at once
    raise Terminated(f"got {signal.Signals(signum).name}: the launcher is ending the job "
                     "(a peer failed, or the job was cancelled)")


def rank_signal_defaults(config: RunPlan) -> None:
    """In a rank, SIGINT ends the process at once (unless it is the exit signal): the launcher
    reports it, and N ranks printing KeyboardInterrupt tracebacks say nothing more. SIGTERM
    (unless it is the exit signal, whose handler :class:`StopControl` installs afterwards)
    raises :class:`Terminated`, so the rank reports its stage and op before it exits."""
    if exit_signal(config) != signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, _raise_terminated)


def launcher_signals(config: RunPlan) -> tuple[int, ...]:
    """What the local launcher forwards to its ranks."""
    extra = exit_signal(config)
    return (signal.SIGTERM, signal.SIGINT, *(() if extra is None else (extra,)))
