"""Child processes with a hard deadline: every step runs its work in a subprocess of its own
session, so a hang, a crash in CUDA or a stuck NCCL call costs that step only, and a step past
its budget is killed with everything it started (no orphans)."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Result:
    cmd: list[str]
    returncode: int | None  # None: killed at the deadline
    output: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def tail(self, chars: int = 1500) -> str:
        return self.output[-chars:]


def child_env(pythonpath: list[Path]) -> dict[str, str]:
    """The environment of every child: the wheel target and the repository first on PYTHONPATH
    (the node has no megatron-core of its own), warnings off, output unbuffered."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    parts = [str(p) for p in pythonpath] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    return env


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def run(cmd: list[str], timeout: float, env: dict[str, str], log: Path | None = None) -> Result:
    """Run ``cmd`` in the repository; after ``timeout`` seconds kill its process group."""
    start = time.monotonic()
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True) as proc:
        try:
            out, _ = proc.communicate(timeout=max(timeout, 1.0))
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            code = None
    if log is not None:
        log.write_text(f"$ {shlex.join(cmd)}\n{out}")
    return Result(cmd, code, out, time.monotonic() - start)


def shell(cmd: list[str]) -> str:
    """``cmd`` as a copy-pasteable line (relative to the repository root)."""
    return shlex.join(os.path.relpath(c, REPO) if c.startswith(str(REPO)) else c for c in cmd)
