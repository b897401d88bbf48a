"""``--use-distributed-optimizer``: a stage's optimizer state sharded over its data-parallel group.

Why: every data-parallel replica of a stage holds the same weights, receives the same averaged
gradients and, unsharded, keeps the same AdamW moments and fp32 masters: D copies of 12 bytes
per parameter (bf16) for nothing. ZeRO-1 (Megatron-LM's distributed optimizer) cuts the stage's
flat parameter vector (optimizer parameter order) into D near-equal contiguous ranges
(:mod:`~megatron.pipeline.runtime.sharding`, the same arithmetic as AMDP's replica shards);
replica ``r`` keeps state for, and steps, range ``r`` only (``StageAdamW(shards=...)``):

1. gradients: one reduce-scatter of the stage's flat gradients (each part padded to the longest,
   as the collective wants equal parts), divided by D: replica ``r`` gets the average of its
   range, written into that range of ``.grad`` (the rest of ``.grad`` is not read any more).
   ``dist.reduce_scatter_tensor`` runs on NCCL and, since torch 2.x, on gloo; on a backend
   without it the fallback is an all-reduce of the flat gradients keeping the own range
   (the same sums). With ``--overlap-grad-reduce`` the buckets' all-reduces already averaged
   every gradient and nothing more is exchanged;
2. the norm for clipping and the non-finite check: each replica's squared norm of its range,
   summed over the group (an all-reduce), so every replica decides to clip, skip (fp16
   overflow: ``found_inf`` agrees) or roll back alike. At TP > 1 the DP groups are per TP
   index and each TP rank's flat space holds its TP shards: the range's squares are split into
   TP-sharded and replicated elements, summed over the DP group, then the sharded part over the
   TP group and the replicated part counted once (:meth:`tp_grad_sq_norm`), the same value on
   every rank of the stage;
3. the step of the own range (the Adam arithmetic is element-wise, so every element gets the
   bits the unsharded step gives it), then an all-gather of the ranges into every replica's
   parameters. Post-validation's rollback undoes the own range and gathers again.

``--overlap-param-gather`` starts that all-gather asynchronously and waits for it (:meth:`wait_params`)
just before the stage next reads its weights: the stage's next F, B or BW (the worker calls
:meth:`~megatron.pipeline.runtime.worker.StageWorker.params_ready`), a weight policy that reads
them at the update, the next step or rollback, and the end of a training segment. In the
runtime the gather thus runs behind the wait for the next op's input; no op ever computes on a
half-gathered weight, which is why the result is bitwise the non-overlapped run's, under
stage-local (asynchronous) steps too.

With one data-parallel replica (the emulator always) nothing is sharded: the flag is a no-op
there, said once in the log.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron.pipeline.runtime.executors.send_reaper import wait_or_raise
from megatron.pipeline.runtime.stage_optimizer import StageOptimizer
from megatron.pipeline.runtime.sharding import (
    STATE_KINDS, add_whole_state, assign_flat, flat_dtype, flat_values, owned_entries, owned_ranges, owned_state,
    padded_part, part_length, shard_range, unpadded)
from megatron.pipeline.runtime.tensor_parallel import count_replicated_once, split_sq_sums
from megatron.pipeline.runtime.tied_embeddings import is_tied_copy

# torch >= 2.11 renames the tensor collectives (the old names warn); same signatures.
_reduce_scatter: Callable[..., Any] = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def data_parallel_shards(named: list[tuple[str, torch.nn.Parameter]], dp_size: int,
                         dp_rank: int) -> dict[str, tuple[int, int]]:
    """Name -> the flat range of that parameter replica ``dp_rank`` owns (``StageAdamW(shards=)``)."""
    params = [p for _, p in named if p.requires_grad]
    names = [name for name, p in named if p.requires_grad]
    lo, hi = shard_range(sum(p.numel() for p in params), dp_size, dp_rank)
    return {names[i]: (start, stop) for i, start, stop in owned_ranges(params, lo, hi)}


class DataParallelShardedOptimizer(StageOptimizer):
    """A sharded stage optimizer (``StageAdamW(shards=data_parallel_shards(...))``) plus the
    data-parallel collectives around its step; see the module docstring.

    It speaks the worker's :class:`~megatron.pipeline.runtime.stage_optimizer.StageOptimizer` contract,
    so the worker, post-validation, weight policies and checkpoints use it like any stage
    optimizer. The process group arrives with :meth:`attach` (the transport owns the groups).
    """

    sharded = True

    def __init__(self, inner: Any, dp_rank: int, dp_size: int, overlap_param_gather: bool = False):
        if not inner.sharded:
            raise ValueError("DataParallelShardedOptimizer needs an optimizer built with shards=")
        self.inner = inner
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.overlap_param_gather = overlap_param_gather
        self._params = inner.parameters()
        self.numel = sum(p.numel() for p in self._params)
        self.lo, self.hi = shard_range(self.numel, dp_size, dp_rank)
        self.group: dist.ProcessGroup | None = None
        self.timeout = timedelta(minutes=10)
        self._pending: tuple[dist.Work, torch.Tensor] | None = None  # the in-flight parameter gather
        self._fallback = False  # the backend has no reduce-scatter: all-reduce and keep the own range
        #: Seconds :meth:`wait_params` spent waiting for overlapped gathers (the benchmark reads it).
        self.gather_wait_seconds = 0.0

    def attach(self, group: dist.ProcessGroup | None, timeout: timedelta) -> None:
        """The stage's data-parallel group and the pipeline timeout for its waits."""
        self.group, self.timeout = group, timeout

    # -- what the worker, the weight policies and checkpoints read -----------------------
    @property
    def step_count(self) -> int:
        return self.inner.step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.inner.step_count = value

    @property
    def exact(self) -> bool:
        return self.inner.exact

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.inner.parameters()

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return self.inner.named_parameters()

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this replica: about 1/D of the unsharded optimizer's."""
        return self.inner.state_bytes()

    def clip_coef(self, total_norm: float, max_norm: float) -> float:
        return self.inner.clip_coef(total_norm, max_norm)

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    # -- gradients ---------------------------------------------------------------------
    def _grads(self) -> list[torch.Tensor]:
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self._params]

    def reduce_gradients(self) -> bool:
        """Average the own range of the stage's gradients over the group (a reduce-scatter)."""
        grads = self._grads()
        flat = flat_values(grads)
        n, d = self.numel, self.dp_size
        mine = torch.empty(part_length(n, d), dtype=flat.dtype, device=flat.device)
        if not self._fallback:
            padded = torch.cat([padded_part(flat, n, d, r) for r in range(d)])
            try:
                _reduce_scatter(mine, padded, group=self.group)
            except RuntimeError as exc:  # every replica runs the same backend: all fall back alike
                if "not supported" not in str(exc).lower() and "unsupported" not in str(exc).lower():
                    raise
                self._fallback = True
        if self._fallback:
            dist.all_reduce(flat, group=self.group)
            mine = flat[self.lo:self.hi]
        mine = mine[:self.hi - self.lo] / d
        assign_flat(grads, mine, self.lo)
        return True

    def grad_sq_norm(self) -> torch.Tensor:
        """The stage's squared gradient norm: the own ranges' sums of squares, summed over the group."""
        total = self.inner.owned_grad_sq_norm()
        dist.all_reduce(total, group=self.group)
        return total

    def tp_grad_sq_norm(self, tp_group: dist.ProcessGroup) -> torch.Tensor:
        """The squared gradient norm of the whole, unsharded stage at TP > 1 (float64, the same
        bits on every TP and DP rank of the stage).

        This TP rank's flat space holds its shards of the TP-sharded parameters and whole copies
        of the replicated ones; each DP replica averaged only its range of it. So the own range's
        squares are split by the kind of parameter (``[sharded, replicated]``), summed over the DP
        group (the whole local flat space), then over the TP group with the replicated part from
        TP rank 0 only (counted once)."""
        parts = ((self._params[i], None if self._params[i].grad is None else
                  self._params[i].grad.reshape(-1)[start:stop])
                 for i, start, stop in owned_ranges(self._params, self.lo, self.hi)
                 if stop > start and not is_tied_copy(self._params[i]))  # a tied embedding once
        sums = split_sq_sums(parts).to(self._params[0].device)  # an empty range's zeros too
        dist.all_reduce(sums, group=self.group)
        return count_replicated_once(sums, tp_group).sum()

    # -- the step and its undo ---------------------------------------------------------
    def step(self, lr: float, grad_scale: float = 1.0, grads_disposable: bool = False) -> None:
        self.wait_params()
        self.inner.step(lr, grad_scale=grad_scale, grads_disposable=grads_disposable)
        self._gather_params()

    def step_consuming_grads(self, lr: float, grad_scale: float = 1.0) -> None:
        """The inner optimizer's :meth:`StageAdamW.step_consuming_grads` (the caller zeroes grads next)."""
        self.step(lr, grad_scale, grads_disposable=True)

    def roll_back_exactly(self, params: list[torch.nn.Parameter]) -> None:
        self.inner.roll_back_exactly(params)  # the own range's slots of ``params``

    def rollback(self, lr: float, grad_scale: float = 1.0) -> None:
        self.wait_params()
        self.inner.rollback(lr, grad_scale=grad_scale)
        self._gather_params()

    def _gather_params(self) -> None:
        """Every replica's own range into everyone's parameters (asynchronously if overlapping)."""
        dtype = flat_dtype(self._params)
        mine = padded_part(flat_values(self._params, self.lo, self.hi, dtype), self.numel, self.dp_size, self.dp_rank)
        out = torch.empty(mine.numel() * self.dp_size, dtype=dtype, device=mine.device)
        work = _all_gather(out, mine, group=self.group, async_op=True)
        self._pending = (work, out)
        if not self.overlap_param_gather:
            self.wait_params()

    def wait_params(self) -> None:
        """Finish an in-flight parameter gather (no-op if none): the weights are whole after it."""
        if self._pending is None:
            return
        work, out = self._pending
        self._pending = None
        start = time.perf_counter()
        wait_or_raise(work, self.timeout, "the data-parallel all-gather of the distributed optimizer's parameters")
        self.gather_wait_seconds += time.perf_counter() - start
        assign_flat(self._params, unpadded(out.chunk(self.dp_size), self.numel))

    # -- checkpoints -----------------------------------------------------------------------
    def full_state_dict(self) -> dict:
        """The whole stage's optimizer state, as the unsharded optimizer saves it (moments and
        half-precision masters in parameter shape): every replica's ranges gathered over the
        group. A collective: checkpoints are written by every replica at the same drained
        boundary. Why gather: a checkpoint of it is a plain one, so it loads into any other
        layout (TP, PP, DP, split, schedule, with or without this flag) like one, and
        :meth:`load_state_dict` cuts this replica's ranges back out bit for bit."""
        own = self.inner.state_dict()
        names = {id(p): name for name, p in self.inner.named_parameters()}
        ordered = [names[id(p)] for p in self._params]
        whole: dict[str, dict[str, torch.Tensor]] = {}
        for kind in STATE_KINDS:
            mine = owned_state(own["params"], ordered, self._params, self.lo, self.hi, kind)
            padded = padded_part(mine, self.numel, self.dp_size, self.dp_rank)
            out = torch.empty(padded.numel() * self.dp_size, dtype=padded.dtype, device=padded.device)
            _all_gather(out, padded, group=self.group)
            add_whole_state(whole, kind, unpadded(out.chunk(self.dp_size), self.numel), ordered, self._params)
        for name, entry in own["params"].items():  # parameters outside the sharded set are whole already
            whole.setdefault(name, entry)
        return {**{k: v for k, v in own.items() if k != "params"}, "params": whole}

    def state_dict(self) -> dict:
        """The own range's state; marked so that a checkpoint index lists the file as sharded."""
        return {**self.inner.state_dict(), "data_parallel_shard": [self.dp_rank, self.dp_size]}

    def load_state_dict(self, sd: dict) -> None:
        """This replica's shard; a whole (replicated) state is cut to the owned ranges first."""
        shard = sd.get("data_parallel_shard")
        if shard is None:
            sd = {**sd, "params": self._owned_entries(sd["params"])}
        elif list(shard) != [self.dp_rank, self.dp_size]:
            raise ValueError(f"optimizer state of data-parallel shard {shard[0]} of {shard[1]}, "
                             f"this replica owns shard {self.dp_rank} of {self.dp_size}")
        self.inner.load_state_dict({k: v for k, v in sd.items() if k != "data_parallel_shard"})

    def _owned_entries(self, entries: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
        named = self.inner.named_parameters()
        return owned_entries(entries, [n for n, _ in named], [p for _, p in named], self.lo, self.hi)
