"""Local multi-process launch for ``python pretrain_gpt.py --pipeline-model-parallel-size N``.

Under ``torchrun`` (or Slurm + torchrun) this is not used. Without it, a laptop user gets
one process per rank anyway, spawned only after the flags have been validated. If any rank
dies, the others are given a grace period to fail on their own (they name the stage and
op), then terminated, so the launch never hangs.

On CPU the ranks are forked from the launching process, which has already imported torch
and megatron-core: importing them costs ~10 s of CPU per process, so N exec'd ranks on a
2-core laptop spend most of a short run importing. Forking is only used when it is safe:
no CUDA context, no extra Python threads. Otherwise (GPU runs) each rank is a fresh
``python`` process, as torchrun would start it.

The launcher owns its ranks: each one dies with it (:mod:`megatron.trainer.launch.process_guard`,
the kernel's parent-death signal), and SIGTERM, SIGINT and the run's ``--exit-signal`` sent
to the launcher are forwarded to every rank, so ``kill``, Ctrl-C or a container stop reach
them (with ``--exit-signal-handler`` they save a checkpoint first and exit 0).

With ``--max-restarts N`` a failed attempt (a rank died, or hung and its peers timed out) is
followed by a fresh start of every rank, up to N times, as ``torchrun --max-restarts`` does:
the ranks get torchrun's ``TORCHELASTIC_RESTART_COUNT`` / ``TORCHELASTIC_MAX_RESTARTS``, so
they rendezvous in a new store namespace (:mod:`megatron.trainer.launch.rendezvous`) and say
which restart they are. A rank stopped by SIGSTOP cannot fail by itself: the launcher does not
wait out the grace period for it, and continues it after SIGTERM so that the SIGTERM acts.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Protocol

from megatron.trainer.launch.process_guard import LAUNCHER_PID_ENV, die_with_parent, exit_code_of
from megatron.trainer.environment import LAUNCHED_ENV, MAX_RESTARTS_ENV, RESTART_COUNT_ENV



def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, world_size: int, port: int, attempt: int = 0,
                     max_restarts: int = 0) -> dict[str, str]:
    """The torchrun-style variables one local rank runs under (restart count included)."""
    return dict(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        **{LAUNCHED_ENV: "1", LAUNCHER_PID_ENV: str(os.getpid()),
           RESTART_COUNT_ENV: str(attempt), MAX_RESTARTS_ENV: str(max_restarts)},
    )


def grace_for(pipeline_timeout_seconds: float) -> float:
    """How long the other ranks get to fail on their own once one failed: a survivor notices a
    dead or hung peer within one pipeline timeout; 30 s more to print and exit. At most the
    150 s the launcher always allowed (the default timeout, 300 s, is for a hung peer only:
    a dead one closes its connections and is noticed at once)."""
    return min(150.0, pipeline_timeout_seconds + 30.0)


def is_stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP, a debugger): state T or t in /proc (Linux; else False)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"T", b"t")


class RankProcess(Protocol):
    """What the supervision loop needs of a rank (``subprocess.Popen`` has it)."""

    returncode: int | None
    pid: int

    def poll(self) -> int | None: ...
    def send_signal(self, sig: int) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def kill(self) -> None: ...


class ForkedRank:
    """A rank forked from this process, running ``target()`` with its rank environment."""

    def __init__(self, target: Callable[[], int], env: dict[str, str],
                 reset_signals: Sequence[int] = ()):
        sys.stdout.flush()
        sys.stderr.flush()
        launcher = os.getpid()
        pid = os.fork()
        if pid == 0:  # child: never return into the launcher's stack
            code = 1
            try:
                for sig in reset_signals:  # the launcher's forwarding handlers are not the rank's
                    signal.signal(sig, signal.SIG_DFL)
                die_with_parent(launcher)
                os.environ.update(env)
                name_this_process(f"megatron-rank{env['RANK']}")
                code = int(target() or 0)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:  # noqa: BLE001 - report and exit, whatever it was
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0)
            time.sleep(0.05)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def name_this_process(name: str) -> None:
    """Show a forked rank as e.g. ``megatron-rank2`` in ps/top (Linux; best effort).

    A forked child keeps its parent's command line and its initial environment block in
    /proc, so without a name its ranks are indistinguishable from outside.
    """
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def fork_is_safe() -> bool:
    """Forking a rank is safe here: POSIX, no CUDA context, no other Python threads."""
    if not hasattr(os, "fork") or threading.active_count() > 1:
        return False
    torch = sys.modules.get("torch")
    return torch is None or not torch.cuda.is_initialized()


class SignalForwarder:
    """Queues the signals the launcher receives; :func:`supervise` passes them to every rank.

    Installed before the first rank starts, so no signal falls between spawning and
    supervising; forwarding happens in the supervision loop, not in the handler.
    """

    def __init__(self, signals: Sequence[int]):
        self.signals = tuple(dict.fromkeys(signals))
        self.pending: list[int] = []
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> SignalForwarder:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._queue)
        return self

    def _queue(self, signum: int, _frame: object) -> None:
        self.pending.append(signum)
        self.received.append(signum)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def forward(self, procs: Sequence[RankProcess]) -> None:
        while self.pending:
            sig = self.pending.pop(0)
            print(f"[megatron-async] launcher got {signal.Signals(sig).name}: forwarding it to "
                  f"{sum(p.poll() is None for p in procs)} rank(s)", file=sys.stderr, flush=True)
            for p in procs:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:  # exited meanwhile
                    pass


def launch_local(world_size: int, argv: Sequence[str], grace_seconds: float = 150.0,
                 target: Callable[[], int] | None = None,
                 forward_signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
                 max_restarts: int = 0, env: dict[str, str] | None = None) -> int:
    """Run ``world_size`` ranks on this machine; return the launch's exit code.

    With ``target`` (and :func:`fork_is_safe`), ranks are forked and call ``target()``;
    otherwise each rank runs ``python *argv``. ``forward_signals`` received by the launcher
    go to every rank. When one of them stopped the ranks (any rank failed), the launcher then
    dies of that signal itself, as a program without a handler would: promptly (no interpreter
    teardown of torch) and with the status a shell expects (128 + N). Otherwise a failed
    attempt is followed by a new one while ``max_restarts`` allows. ``env``: more variables for
    every rank.
    """
    fork = target is not None and fork_is_safe()
    with SignalForwarder(forward_signals) as forwarder:
        for attempt in range(max_restarts + 1):
            port = free_port()  # the dead attempt's store went with its rank 0
            procs: list[RankProcess] = []
            for rank in range(world_size):
                rank_env = {**(env or {}), **rank_environment(rank, world_size, port, attempt, max_restarts)}
                if fork:
                    procs.append(ForkedRank(target, rank_env, forwarder.signals))  # type: ignore[arg-type]
                else:
                    procs.append(subprocess.Popen([sys.executable, *argv], env={**os.environ, **rank_env}))
            code = supervise(procs, grace_seconds, forwarder)
            if code == 0 or forwarder.received or attempt == max_restarts:
                break
            print(f"[megatron-async] launcher: a rank failed (exit code {code}); every rank ended; "
                  f"starting them again (restart {attempt + 1} of {max_restarts})", file=sys.stderr, flush=True)
    if code != 0 and forwarder.received:
        die_of(forwarder.received[0])
    return code


def die_of(sig: int) -> None:
    """End this process by ``sig``'s default action (after flushing what it printed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal whose default action is not to terminate


def _only_stopped_left(procs: Sequence[RankProcess]) -> bool:
    """Every rank still running is stopped: none of them can fail by itself, waiting is useless."""
    return all(is_stopped(p.pid) for p in procs if p.poll() is None)


def supervise(procs: Sequence[RankProcess], grace_seconds: float,
              forwarder: SignalForwarder | None = None) -> int:
    """Wait for every rank; once one fails, give the others ``grace_seconds`` to follow."""
    failed_at: float | None = None
    code = 0
    while any(p.poll() is None for p in procs):
        if forwarder is not None:
            forwarder.forward(procs)
        for p in procs:
            rc = p.poll()
            if rc not in (None, 0) and failed_at is None:
                failed_at, code = time.monotonic(), rc
        if failed_at is not None and (time.monotonic() - failed_at > grace_seconds or _only_stopped_left(procs)):
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
                    p.send_signal(signal.SIGCONT)  # a stopped rank acts on SIGTERM once continued
            break
        time.sleep(0.2)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return exit_code_of(code or next((p.returncode for p in procs if p.returncode), 0))
