"""Bucketed data-parallel gradient reduction that overlaps the last backward of a window.

Why: without overlap the step waits for one all-reduce of every gradient; Megatron-LM's DDP
instead groups parameters into buckets in reverse order of use and all-reduces a bucket as soon
as its gradients are final, so the reduction runs behind the rest of the backward pass.

When a gradient is final: a stage accumulates ``a`` micro-batches per update (the window). Per
(update, chunk) this counts the ops that finish a micro-batch's weight gradients -- BW, or W
under the B/W split (B leaves the deferred part to W). The op that brings the count to ``a`` is
the window's last one for that chunk: during it, ``register_post_accumulate_grad_hook`` marks
each parameter final as autograd accumulates it, and a bucket whose parameters are all final is
launched (``dist.all_reduce(async_op=True)``) from inside the backward. Whatever that op did not
reach through a hook (W's deferred gradients are added outside autograd; parameters without a
gradient) is launched when the op ends. :meth:`finish`, at the step, launches anything still
pending (a window this stage never completed), waits, divides by DP and writes back.

Each bucket copies its gradients into one contiguous buffer at launch (one copy per bucket,
never a flat copy of all gradients); ``.grad`` stays a tensor of its own because the optimizer
frees and re-creates gradients (``zero_grad``), which would silently detach views into a buffer.
A gradient op of a chunk whose buckets are in flight raises: the reduced values would overwrite
what it accumulated.

A parameter listed by several chunks (the tied embedding the V layout's stage 0 shares between
its first and last chunk) accumulates from all of them: it gets a bucket of its own, owned by
those chunks, which is final (and launches: from the hook inside the op, or at its end) only in
the window's last completing op of the last of its chunks to complete.
"""
from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.pipeline.runtime.executors.send_reaper import wait_or_raise


@dataclass
class GradBucket:
    """Parameters whose gradients are all-reduced together, and their in-flight reduction."""

    chunk: int  # the first of ``chunks``
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor | None = None
    work: dist.Work | None = None
    pending: set[int] = field(default_factory=set)  # ids of parameters not yet final in this op
    chunks: frozenset[int] = frozenset()  # the chunks accumulating into it (default: {chunk})
    done: set[int] = field(default_factory=set)  # of ``chunks``, those whose window completed
    armed: bool = False  # in the op that makes it final: its hooks may launch it

    def __post_init__(self) -> None:
        if not self.chunks:
            self.chunks = frozenset({self.chunk})

    @property
    def launched(self) -> bool:
        return self.buffer is not None


def make_buckets(chunk_params: Sequence[Sequence[torch.nn.Parameter]], bucket_size: int) -> list[GradBucket]:
    """Buckets of at least ``bucket_size`` elements (the last of a chunk may be smaller), per
    chunk in reverse order of the chunk's parameters (the order backward finishes them); a
    bucket holds one dtype. A parameter listed by several chunks gets a bucket of its own,
    owned by all of them (after the others)."""
    holders: dict[int, list[int]] = {}
    for chunk, params in enumerate(chunk_params):
        for p in params:
            if chunk not in holders.setdefault(id(p), []):
                holders[id(p)].append(chunk)
    buckets: list[GradBucket] = []
    shared: list[GradBucket] = []
    for chunk, params in enumerate(chunk_params):
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(list(params)):
            if len(holders[id(p)]) > 1:
                if holders[id(p)][0] == chunk:
                    shared.append(GradBucket(chunk, [p], chunks=frozenset(holders[id(p)])))
                continue
            if current and (size >= bucket_size or p.dtype != current[0].dtype):
                buckets.append(GradBucket(chunk, current))
                current, size = [], 0
            current.append(p)
            size += p.numel()
        if current:
            buckets.append(GradBucket(chunk, current))
    return buckets + shared


class OverlappedGradReduce:
    """One stage's buckets over its data-parallel group; see the module docstring."""

    def __init__(self, chunk_params: Sequence[Sequence[torch.nn.Parameter]], bucket_size: int,
                 group: dist.ProcessGroup | None, size: int, timeout: timedelta):
        self.buckets = make_buckets(chunk_params, bucket_size)
        self.group, self.size, self.timeout = group, size, timeout
        self._done: Counter[tuple[int, int]] = Counter()  # (update, chunk) -> completing ops so far
        self._bucket_of: dict[int, GradBucket] = {}
        #: How each bucket was launched, in order: "backward" (from a hook inside the op),
        #: "op end" (when the completing op returned) or "step" (at :meth:`finish`). Tests
        #: and the benchmark read it; cleared by :meth:`finish`'s caller when it wants to.
        self.launches: list[str] = []
        self.wait_seconds = 0.0  # time :meth:`finish` spent waiting for reductions, summed
        for bucket in self.buckets:
            for p in bucket.params:
                self._bucket_of[id(p)] = bucket
                p.register_post_accumulate_grad_hook(self._on_grad)

    # -- during the backward ---------------------------------------------------------
    @contextlib.contextmanager
    def grad_op(self, update: int, window: int, chunk: int, completes: bool) -> Iterator[None]:
        """Around an op that accumulates gradients of ``chunk`` for update ``update``, whose
        window is ``window`` micro-batches (read per op: a batch-size rampup changes it);
        ``completes``: the op finishes that micro-batch's gradients (BW, or W)."""
        mine = [b for b in self.buckets if chunk in b.chunks]
        if any(b.launched for b in mine):
            raise RuntimeError(f"chunk {chunk}: a gradient op of update {update} runs while the "
                               "chunk's gradient buckets are being reduced (before the step)")
        key = (update, chunk)
        last = completes and self._done[key] + 1 == window
        # the buckets this op makes final: the chunk's own, and a shared one whose other chunks are done
        final = [b for b in mine if b.chunks - b.done <= {chunk}] if last else []
        for b in final:
            b.pending = {id(p) for p in b.params}
            b.armed = True
        try:
            yield
        finally:
            for b in final:
                b.armed = False
        if not completes:
            return
        if last:
            del self._done[key]
            for b in mine:
                b.done.add(chunk)
            for b in final:
                if not b.launched:
                    self._launch(b, "op end")
        else:
            self._done[key] += 1

    def _on_grad(self, p: torch.Tensor) -> None:
        bucket = self._bucket_of[id(p)]
        if not bucket.armed or bucket.launched:
            return
        bucket.pending.discard(id(p))
        if not bucket.pending:
            self._launch(bucket, "backward")

    def _launch(self, bucket: GradBucket, when: str) -> None:
        bucket.buffer = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                   for p in bucket.params])
        bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
        self.launches.append(when)

    # -- at the step -------------------------------------------------------------------
    def finish(self) -> None:
        """Reduce what is still pending, wait for every bucket, write the averages back."""
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket, "step")
        start = time.perf_counter()
        for i, bucket in enumerate(self.buckets):
            assert bucket.work is not None
            wait_or_raise(bucket.work, self.timeout, f"the data-parallel all-reduce of gradient bucket {i}")
        self.wait_seconds += time.perf_counter() - start
        for bucket in self.buckets:
            assert bucket.buffer is not None
            bucket.buffer /= self.size
            offset = 0
            for p in bucket.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                n = p.numel()
                p.grad.copy_(bucket.buffer[offset:offset + n].view_as(p.grad))
                offset += n
            bucket.buffer = bucket.work = None
            bucket.done.clear()
