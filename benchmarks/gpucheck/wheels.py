"""Install the wheelhouse into a private target, offline (``pip --no-index --no-deps``).

Only what the interpreter lacks is installed: a distribution it already has is kept (the image's
numpy is the one its torch was built against), except a project pin (``==``, megatron-core) at
another version, which the target then shadows (the target comes first on PYTHONPATH).
"""
from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

from benchmarks.gpucheck.proc import Result, run
from tools.wheelhouse import canonicalize_name, project_requirements, wheel_name


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def wheels_to_install(wheels: list[Path], installed=installed_version) -> tuple[list[Path], list[str]]:
    """(wheels to install, names kept as installed). ``installed(name)`` -> version or None."""
    pins = {canonicalize_name(r.name): r.specifier for r in project_requirements()}
    todo, kept = [], []
    for wheel in sorted(wheels):
        name, version = wheel_name(wheel.name), wheel.name.split("-")[1]
        have = installed(name)
        pinned = pins.get(name)
        if have is None or (pinned is not None and "==" in str(pinned) and have != version):
            todo.append(wheel)
        else:
            kept.append(f"{name} {have}")
    return todo, kept


def install(wheelhouse: Path, target: Path, timeout: float) -> tuple[Result | None, list[Path], list[str]]:
    todo, kept = wheels_to_install(sorted(wheelhouse.glob("*.whl")))
    if not todo:
        return None, todo, kept
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
           "--disable-pip-version-check", "--upgrade", "--target", str(target), *map(str, todo)]
    return run(cmd, timeout, env=dict(os.environ)), todo, kept
