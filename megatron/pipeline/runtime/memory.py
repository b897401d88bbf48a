"""Activation-memory accounting that works on any device.

Counts the bytes autograd saves for backward per micro-batch (parameters excluded, each
storage once), so the runtime can report in-flight activation memory on CPU as well as
GPU, and tests can compare it with the timing simulator's prediction.

Counting bytes takes a saved-tensor hook on every tensor autograd saves (thousands per forward
of a real model), so it is opt-in: a meter made with ``measure_bytes=False`` installs no hook and
only keeps the set of micro-batches holding activations (``peak_count`` stays exact, every byte
figure is 0). The trainer measures bytes with ``--log-activation-memory``; a profiled Zero Bubble
schedule turns measuring on around its profiled ops (:meth:`ActivationMeter.measuring`), the one
place the runtime itself reads the bytes.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch


def _unchanged(t: torch.Tensor) -> torch.Tensor:
    """The unpack hook: the meter only looks at what is saved."""
    return t


class _SavedBytes:
    """The block of :meth:`ActivationMeter.record` with byte measuring: a plain object, not a
    generator context manager, since it runs on every forward and its pack hook on every
    saved tensor."""

    __slots__ = ("meter", "key", "seen", "total", "hooks")

    def __init__(self, meter: "ActivationMeter", key: object):
        self.meter, self.key = meter, key
        self.seen: set[int] = set()
        self.total = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, _unchanged)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.seen and ptr not in self.meter._param_storages:
            self.seen.add(ptr)
            self.total += storage.nbytes()
        return t

    def __enter__(self) -> None:
        self.hooks.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.hooks.__exit__(*exc)
        if exc[0] is None:
            self.meter._add(self.key, self.total)


class ActivationMeter:
    """Live and peak activation bytes / micro-batch counts of one stage."""

    def __init__(self, parameters: Iterable[torch.Tensor], measure_bytes: bool = True):
        self._param_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self._live: dict[object, int] = {}
        self.measure_bytes = measure_bytes
        self.peak_bytes = 0  # since the last reset_peaks (one logging interval)
        self.peak_count = 0
        self.run_peak_bytes = 0  # over the whole run
        self.run_peak_count = 0

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Measure bytes inside the block even if this meter was made without (profiling)."""
        before, self.measure_bytes = self.measure_bytes, True
        try:
            yield
        finally:
            self.measure_bytes = before

    def record(self, key: object) -> contextlib.AbstractContextManager[None]:
        """Attribute everything autograd saves inside the block to ``key``; without byte
        measuring, only mark ``key`` live (no hook)."""
        if self.measure_bytes:
            return _SavedBytes(self, key)
        self._add(key, 0)
        return contextlib.nullcontext()

    def _add(self, key: object, nbytes: int) -> None:
        self._live[key] = self._live.get(key, 0) + nbytes
        if len(self._live) > self.peak_count:
            self.peak_count = len(self._live)
            self.run_peak_count = max(self.run_peak_count, self.peak_count)
        if nbytes:
            self._raise_peak_bytes()

    def _raise_peak_bytes(self) -> None:
        self.peak_bytes = max(self.peak_bytes, sum(self._live.values()))
        self.run_peak_bytes = max(self.run_peak_bytes, self.peak_bytes)

    def release(self, key: object) -> None:
        self._live.pop(key, None)

    def retain_only(self, key: object, tensors: Iterable[torch.Tensor]) -> None:
        """``key`` now holds only ``tensors`` (e.g. what a deferred W keeps after its B).

        Counted like saved tensors (parameters excluded, each storage once); with nothing
        left the key is released. Without byte measuring the key just stays live.
        """
        seen: set[int] = set()
        total = 0
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self._param_storages and ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
        if not seen:
            self.release(key)
            return
        self._live[key] = total if self.measure_bytes else 0
        if self.measure_bytes:
            self._raise_peak_bytes()

    def live_bytes(self, key: object) -> int:
        """Bytes ``key`` holds now (0 once released)."""
        return self._live.get(key, 0)

    @property
    def live_count(self) -> int:
        return len(self._live)

    def reset_peaks(self) -> None:
        self.peak_bytes = sum(self._live.values())
        self.peak_count = len(self._live)
