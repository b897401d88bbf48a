"""What a restarted run says first: ``restart k of N: resuming from iteration I (lost J iterations)``.

A restart (torchrun's ``--max-restarts``, the local launcher's, a Slurm requeue) starts new
processes that know which attempt they are (``TORCHELASTIC_RESTART_COUNT``, or Slurm's
``SLURM_RESTART_COUNT``) and where the checkpoint puts them (I), but not how far the dead
attempt got. So the logging rank keeps that in ``--save`` as it logs: ``progress_iteration.txt``
holds the last iteration it logged (replaced atomically; no fsync: it only feeds this message,
and a lost update makes J smaller, never wrong about the checkpoint). J is therefore exact to
``--log-interval``.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from megatron.trainer.environment import MAX_RESTARTS_ENV, restart_attempt

PROGRESS_FILE = "progress_iteration.txt"


class ProgressRecord:
    """Callable ``(update, reports)`` after the logger: records ``update + 1`` in ``directory``."""

    def __init__(self, directory: str | Path):
        self.path = Path(directory) / PROGRESS_FILE
        self._partial = self.path.with_name(PROGRESS_FILE + ".partial")

    def record(self, iteration: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._partial.write_text(f"{iteration}\n")
        os.replace(self._partial, self.path)

    def __call__(self, update: int, _reports: object) -> None:
        self.record(update + 1)


def read_progress(directory: str | Path | None) -> int | None:
    """The last iteration a previous attempt logged into ``directory``; None if unknown."""
    if directory is None:
        return None
    try:
        text = (Path(directory) / PROGRESS_FILE).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def restart_line(start: int, reached: int | None, env: Mapping[str, str] | None = None) -> str | None:
    """The restart's log line, or None on a first start."""
    env = os.environ if env is None else env
    attempt, requeues = restart_attempt(env), int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    if attempt:
        which = f"restart {attempt} of {env.get(MAX_RESTARTS_ENV, '?')}"
    elif requeues:
        which = f"restart {requeues} (Slurm requeue)"
    else:
        return None
    lost = "an unknown number of iterations" if reached is None else \
        f"{max(0, reached - start)} iteration{'' if reached - start == 1 else 's'}"
    return f"[megatron-async] {which}: resuming from iteration {start} (lost {lost})"
