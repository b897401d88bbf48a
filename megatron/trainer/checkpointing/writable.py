"""Is an output path usable? Asked before hours of work are spent filling it.

Shared by ``--save`` (:mod:`megatron.trainer.checkpointing.paths`) and the tools' output
flags. A path may be missing (it is created later) if its closest existing ancestor is a
directory we can create a file in. The check creates and removes one probe file and
nothing else, so a refused run leaves nothing behind. Writability is probed, not read
from the permission bits: root ignores those, a read-only file system does not.
"""
from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron.trainer.config.run_plan import RunPlan


class OutputPathError(ValueError):
    """An output path that cannot be written; one line naming the flag."""


def nearest_existing(path: str) -> str:
    """``path`` itself if it exists, else its closest existing ancestor (absolute)."""
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def probe_writable(directory: str) -> str | None:
    """None if a file can be created in ``directory`` (it is removed again), else why not."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.remove(probe)
    return None


def check_writable_directory(path: str, flag: str, create_missing: bool = True) -> str:
    """Raise :class:`OutputPathError` unless ``path`` is (or, with ``create_missing``, can be
    created as) a writable directory; return the existing directory that was probed."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise OutputPathError(f"{flag} {path}: exists and is not a directory")
    existing = nearest_existing(path)
    if existing != os.path.abspath(path) and not create_missing:
        raise OutputPathError(f"{flag} {path}: directory does not exist")
    if not os.path.isdir(existing):
        raise OutputPathError(f"{flag} {path}: {existing} is not a directory")
    why = probe_writable(existing)
    if why is not None:
        where = "" if existing == os.path.abspath(path) else f" (nearest existing directory {existing})"
        raise OutputPathError(f"{flag} {path}: not writable{where}: {why}")
    return existing


# Output flags other than --save (which also needs room for a checkpoint): a directory each,
# or a file whose directory must take it.
OUTPUT_DIRECTORIES = ("tensorboard_dir", "trace_dir", "dump_final_params")
OUTPUT_FILES = ("log_json",)


def check_output_flags(config: RunPlan) -> None:
    """Every output flag of :data:`OUTPUT_DIRECTORIES` / :data:`OUTPUT_FILES` that is set can be
    written (:class:`OutputPathError` otherwise), so a bad path fails before training, not in a
    rank at its first log line or at the end of the run."""
    from megatron.trainer.config.job_config import flag_values

    flags = flag_values(config)  # the flags by dest (``vars`` of a RunPlan would be its sections)
    for dest in OUTPUT_DIRECTORIES:
        path = flags.get(dest)
        if path is not None:
            check_writable_directory(path, "--" + dest.replace("_", "-"))
    for dest in OUTPUT_FILES:
        path = flags.get(dest)
        if path is None:
            continue
        flag = "--" + dest.replace("_", "-")
        if os.path.isdir(path):
            raise OutputPathError(f"{flag} {path}: is a directory, not a file")
        check_writable_directory(os.path.dirname(os.path.abspath(path)), f"{flag} {path}: directory")
