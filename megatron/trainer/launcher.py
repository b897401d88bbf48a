"""Local multi-process launch for ``python pretrain_gpt.py --pipeline-model-parallel-size N``.

Under ``torchrun`` (or Slurm + torchrun) this is not used. Without it, a laptop user gets
one process per rank anyway, spawned only after the flags have been validated. If any rank
dies, the others are given a grace period to fail on their own (they name the stage and
op), then terminated, so the launch never hangs.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

LAUNCHED_ENV = "MEGATRON_ASYNC_LAUNCHED"


def is_worker_process() -> bool:
    """True inside torchrun or one of our own spawned ranks."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(world_size: int, argv: Sequence[str], grace_seconds: float = 150.0) -> int:
    """Run ``world_size`` copies of this script as ranks; return the launch's exit code."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ)
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            **{LAUNCHED_ENV: "1"},
        )
        procs.append(subprocess.Popen([sys.executable, *argv], env=env))
    failed_at: float | None = None
    code = 0
    try:
        while any(p.poll() is None for p in procs):
            for p in procs:
                rc = p.poll()
                if rc not in (None, 0) and failed_at is None:
                    failed_at, code = time.monotonic(), rc
            if failed_at is not None and time.monotonic() - failed_at > grace_seconds:
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        for p in procs:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return code or next((p.returncode for p in procs if p.returncode), 0)
