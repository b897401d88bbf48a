"""Receive buffers that are recycled once nothing but the pool references their memory.

Why: every point-to-point receive needs a buffer of the message's shape, and a fresh
``torch.empty`` per message costs an allocation (on CPU, for activation-sized tensors, an
``mmap`` whose pages the kernel zeroes on first touch; on CUDA a caching-allocator lookup).
A pipeline receives the same few shapes over and over, so buffers can be reused.

Why it is not simply "reuse after the op": a received activation is kept by autograd until its
backward (the worker stashes ``received.detach().requires_grad_(True)``, and the graph saves
it), a received gradient can be held by deferred weight gradients until W, a stage whose chunk
returns its input sends a view of it, and post-validation reruns may stash copies. Rather than
asking every holder to say when it is done, the pool hands out an *alias* (a new tensor over the
buffer's storage) and keeps the buffer itself private; every tensor anyone derives from the alias
(views, ``detach``, autograd's saved tensors) holds a reference to the same storage. A buffer is
reused only when its storage's reference count is back to what the pool alone holds. A
reference the pool cannot see does not exist in torch: a tensor's memory is reachable only
through its storage.

On CUDA the same rule is enough: the last reader's kernels were enqueued on the compute stream
before its last reference was dropped, and the next ``irecv`` into the buffer is posted after
that; ProcessGroupNCCL makes its stream wait for the current stream when the receive is posted,
so the receive cannot overwrite data a queued kernel still reads (docs/gpu.md, section 4).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

BufferKey = tuple[tuple[int, ...], torch.dtype, torch.device]


def _storage_use_count() -> Callable[[torch.Tensor], int] | None:
    """How many tensors and storage handles share a tensor's storage; None if this torch
    cannot say (then no buffer is ever reused: always correct, never faster)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return lambda t: count(t.untyped_storage()._cdata)


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as the ``cuda:N`` a tensor made there reports, so a buffer's own device finds
    its kind again."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class ReceiveBuffers:
    """A pool of receive buffers by (shape, dtype, device); see the module docstring.

    Life of a buffer: :meth:`take` gives it to a receive (the transport writes into it);
    :meth:`lend` returns an alias once the receive completed and starts watching the
    storage; the buffer becomes free again once every tensor over its storage is gone.
    Buffers between :meth:`take` and :meth:`lend` are never reclaimed (a pending receive
    writes into them while nothing else references them).
    """

    def __init__(self, reuse: bool = True):
        self._use_count = _storage_use_count() if reuse else None
        self._lent: list[tuple[BufferKey, torch.Tensor]] = []
        self._free: dict[BufferKey, list[torch.Tensor]] = {}
        self.taken = 0  # receives served
        self.allocated = 0  # buffers created for them (taken - allocated: receives without an allocation)

    @property
    def reuses(self) -> bool:
        return self._use_count is not None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer to receive into: a free one of this kind if any, else a new one."""
        key = (tuple(shape), dtype, _indexed(torch.device(device)))
        self.taken += 1
        if self._use_count is not None:
            self._reclaim()
            free = self._free.get(key)
            if free:
                return free.pop()
        self.allocated += 1
        return torch.empty(key[0], dtype=dtype, device=key[2])

    def lend(self, buf: torch.Tensor) -> torch.Tensor:
        """The received ``buf`` as a tensor the caller owns; ``buf`` returns to the pool once
        that tensor and everything derived from it are gone."""
        if self._use_count is None:
            return buf
        alias = buf.detach()  # a new tensor over the same storage: the pool's own stays private
        self._lent.append(((tuple(buf.shape), buf.dtype, buf.device), buf))
        return alias

    def _reclaim(self) -> None:
        assert self._use_count is not None
        still_lent = []
        for key, buf in self._lent:
            # The pool's tensor and the temporary storage handle of the call: nothing else.
            if self._use_count(buf) <= 2:
                self._free.setdefault(key, []).append(buf)
            else:
                still_lent.append((key, buf))
        self._lent = still_lent

    def free_count(self) -> int:
        """Buffers ready for reuse (after reclaiming); for tests."""
        if self._use_count is not None:
            self._reclaim()
        return sum(map(len, self._free.values()))
