"""Releases sent tensors as soon as their sends complete, without ever blocking the op loop.

Why this exists: a gloo ``isend`` work reports ``is_completed() == False`` until ``wait()``
is called on it, however long ago the peer received the data, so reaping sends by polling
``is_completed()`` frees nothing and every activation and gradient a stage sends stays
referenced until the segment ends (7-9 MB per iteration per rank on a small GPT).

Why not wait in the op loop: a gloo send completes only when the peer has *posted* the
matching receive (a rendezvous, even for a few bytes). Waiting there would turn sends into
blocking operations, and a schedule in which two stages each run ahead sending to the other
(Zero Bubble's warm-up with unequal stage costs does) could deadlock; the schedule check and the
emulator model sends as non-blocking. So the waits run in one reaper thread per peer: it
waits on that peer's sends oldest first (the peer posts receives in the order we send), with
the runtime's timeout, and drops each tensor the moment its receive is posted. The op loop
only hands sends over; sent tensors live exactly as long as gloo needs them. ``Work.wait``
releases the GIL, so the threads cost nothing while they wait.

Backends whose works complete on their own (NCCL polls a CUDA event; waiting there would
make the reaper thread's stream wait instead) keep being reaped by ``is_completed()``.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.pipeline.runtime.executors.errors import PipelineRuntimeError


@dataclass
class _Send:
    work: dist.Work
    tensor: torch.Tensor  # referenced until the send completes: gloo reads it until then
    what: object  # what was sent (a Message), named in errors only


def wait_or_raise(work: dist.Work, timeout: timedelta, action: str) -> None:
    """Wait on ``work``; if it fails, raise :class:`PipelineRuntimeError` saying whether
    ``action`` timed out or failed at once (a peer that died closes its connections, and
    its neighbours' waits fail immediately: that is not a timeout)."""
    began = time.monotonic()
    try:
        work.wait(timeout)
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        waited, limit = time.monotonic() - began, timeout.total_seconds()
        if waited >= 0.9 * limit:
            why = f"timed out after {waited:.0f} s (--pipeline-timeout-seconds {limit:.0f})"
        else:
            why = f"failed after {waited:.1f} s, well before the {limit:.0f} s timeout (the peer closed the connection: did it die?)"
        raise PipelineRuntimeError(f"{action} {why}: {exc}") from exc


class _PeerReaper(threading.Thread):
    """Waits on one peer's sends in order; records the first failure and stops."""

    def __init__(self, peer: int, timeout: timedelta):
        super().__init__(name=f"send-reaper-{peer}", daemon=True)
        self.peer = peer
        self.timeout = timeout
        self.sends: queue.SimpleQueue[_Send | None] = queue.SimpleQueue()
        self.error: str | None = None

    def run(self) -> None:
        while (send := self.sends.get()) is not None:
            if self.error is not None:
                continue  # already failed: drop the rest, the rank is going down
            try:
                wait_or_raise(send.work, self.timeout, f"sending {send.what} to rank {self.peer}")
            except PipelineRuntimeError as exc:  # reported to the op loop by check()
                self.error = str(exc)
            del send


class SendReaper:
    """In-flight sends of one stage; see the module docstring for why waits run in threads."""

    def __init__(self, timeout: timedelta, threaded: bool):
        self.timeout = timeout
        self.threaded = threaded
        self._reapers: dict[int, _PeerReaper] = {}
        self._polled: deque[tuple[int, _Send]] = deque()  # not threaded: reaped by is_completed()

    def add(self, peer: int, work: dist.Work, tensor: torch.Tensor, what: object) -> None:
        """Hold ``tensor`` until ``work`` completes; raise if an earlier send failed."""
        self.check()
        send = _Send(work, tensor, what)
        if not self.threaded:
            self._polled.append((peer, send))
            while self._polled and self._polled[0][1].work.is_completed():
                self._polled.popleft()
            return
        reaper = self._reapers.get(peer)
        if reaper is None:
            reaper = self._reapers[peer] = _PeerReaper(peer, self.timeout)
            reaper.start()
        reaper.sends.put(send)

    def check(self) -> None:
        """Raise :class:`PipelineRuntimeError` if a send has failed."""
        for reaper in self._reapers.values():
            if reaper.error is not None:
                raise PipelineRuntimeError(reaper.error)

    def flush(self) -> None:
        """Wait until every send has completed (each wait bounded by the timeout)."""
        for reaper in self._reapers.values():
            reaper.sends.put(None)
        for reaper in self._reapers.values():
            reaper.join()
        self.check()
        self._reapers.clear()
        while self._polled:
            peer, send = self._polled.popleft()
            wait_or_raise(send.work, self.timeout, f"sending {send.what} to rank {peer}")
