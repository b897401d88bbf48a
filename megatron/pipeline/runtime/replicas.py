"""The window update of replicated pipelines (AMDP): replicas of a logical stage sum gradients.

With a :class:`~megatron.pipeline.ir.MultiPipelineLayout` every logical stage ``j`` has one
replica per pipeline, as chunk ``p`` on device ``device(p, j)``. Replicas start identical
(initialisation depends only on the seed and the global parameter name), so they stay
identical if they take the same step on the same gradient. At a ``sync`` OPT:

1. each logical stage's replicas exchange their accumulated gradients and every replica
   adds them up *in pipeline order* (``g_0 + g_1 + ...``, fp32), so every replica, and the
   emulator as well as the one-process-per-device runtime, gets the same bits (an
   all-reduce would sum in a ring order that differs between ranks and from the emulator);
2. the norm for clipping and the non-finite check is that of the group's logical stages,
   each counted once: device ``d`` contributes the squared norm of its pipeline-0 chunk (the
   pipeline-0 placement is the identity, so device ``d`` "owns" logical stage ``d``), and
   the group's values are summed with ``math.fsum`` (exact, so order-independent). The sync
   group is closed under replicas, so every replica of a stage sees the same norm and all
   skip or clip alike.

Losses are scaled by 1/T (T = micro-batches per window over all pipelines), so the summed
gradient is the window's mean, as in a synchronous step over T micro-batches.

Optimizer-state sharding (ZeRO-1 over the replicas, AMDP §3.4): the replicas of a logical
stage hold identical weights, gradients (after the sum) and, unsharded, identical optimizer
states. Sharded, the stage's flat parameter vector (chunk parameter order) is cut into P
contiguous ranges and the replica of pipeline ``p`` keeps AdamW state for, and steps, range
``p`` only (:func:`optimizer_shards`); after the step the replicas all-gather the ranges
(:meth:`ReplicaReduction.finish`). AdamW is element-wise
with per-step scalars (lr, clip coefficient, bias corrections) that every replica computes
alike, so each element gets the bits the unsharded step gives it, and a device keeps 1/P of
the state of each stage it hosts. (The paper's owner scheme gives each device one whole stage
instead; equal ranges make the saving exactly 1/P on every device, whatever the stage sizes.)
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from megatron.pipeline.ir import MultiPipelineLayout, Op
from megatron.pipeline.runtime.parallel import has_replicas
from megatron.pipeline.runtime.sharding import (
    STATE_KINDS, add_whole_state, assign_flat, flat_values, owned_entries, owned_ranges, owned_state, padded_part,
    shard_range, unpadded)
from megatron.pipeline.runtime.tensor_parallel import tp_sq_sum
from megatron.pipeline.runtime.worker import StageWorker, Workers

if TYPE_CHECKING:
    from megatron.pipeline.runtime.transport import Transport


def chunk_grads(worker: StageWorker, chunk: int) -> list[torch.Tensor]:
    """The accumulated gradients of one chunk, in parameter order (zeros where none yet)."""
    grads = []
    for p in worker.setup.chunks[chunk].parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return grads


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def _assign(grads: list[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _sum_in_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def owned_sq_norm(worker: StageWorker) -> float:
    """Squared gradient norm of this device's pipeline-0 chunk (logical stage = device)."""
    grads = chunk_grads(worker, 0)
    if worker.setup.tp_group is not None:  # over the whole (unsharded) stage, as at TP = 1
        return worker.unscale_sq(tp_sq_sum(zip(worker.setup.chunks[0].parameters(), grads), worker.setup.tp_group))
    total = torch.zeros((), dtype=torch.float32)
    for g in grads:
        total += g.float().square().sum().cpu()
    return worker.unscale_sq(float(total))


def prepare(worker: StageWorker, op: Op) -> None:
    """The worker's own pre-step checks (no weight gradient pending) and the non-finite
    injection test hook, before the sums: a poisoned replica makes its stage's sum, hence the
    whole sync group's norm, non-finite, so every replica skips the update alike."""
    worker.grad_sq_norm(op)


def _local_replicas(layout: MultiPipelineLayout,
                    ops: Sequence[Op] | Sequence[StageWorker]) -> dict[int, list[tuple[int, int]]]:
    """Logical stage -> the (device, chunk) replicas of it on the local devices of ``ops`` (or workers)."""
    local: dict[int, list[tuple[int, int]]] = {}
    for op in ops:
        for chunk in range(layout.num_chunks):
            local.setdefault(layout.logical_stage(op.stage, chunk), []).append((op.stage, chunk))
    return local


class ReplicaReduction:
    """The window step's collectives for replicated pipelines, written once over a transport.

    For each logical stage the local devices host, in increasing order (every device of the
    sync group does the same, so the blocking collectives of different replica groups cannot
    wait on each other in a cycle), gather the replicas' flat gradients in pipeline order
    (:meth:`Transport.replica_gather`: local tensors in the emulator, an all-gather in the
    runtime) and sum them in that order; then gather the owned norms over the sync group.
    """

    def norms(self, transport: "Transport", workers: "Workers", ops: Sequence[Op]) -> list[float]:
        for op in ops:
            prepare(workers[op.stage], op)
        layout = workers[ops[0].stage].layout
        assert isinstance(layout, MultiPipelineLayout)
        for j, replicas in sorted(_local_replicas(layout, ops).items()):
            grads = {(d, c): chunk_grads(workers[d], c) for d, c in replicas}
            total = _sum_in_order(transport.replica_gather(j, {k: _flat(g) for k, g in grads.items()}))
            for g in grads.values():
                _assign(g, total)
        device = workers[ops[0].stage].setup.device  # the sync group is an NCCL group on GPUs
        return transport.sync_gather([owned_sq_norm(workers[op.stage]) for op in ops], device)

    def finish(self, transport: "Transport", workers: "Workers", ops: Sequence[Op]) -> None:
        """Sharded optimizer state: every replica takes each range from its owner (pipeline
        ``p`` owns range ``p``), gathered padded to the longest range (gloo's all-gather wants
        equal sizes)."""
        if not _is_sharded(workers[ops[0].stage]):
            return
        layout = workers[ops[0].stage].layout
        assert isinstance(layout, MultiPipelineLayout)
        parts = layout.num_pipelines
        for j, replicas in sorted(_local_replicas(layout, ops).items()):
            params = {(d, c): _chunk_params(workers[d].setup.chunks, c) for d, c in replicas}
            flats = {k: flat_values(ps) for k, ps in params.items()}
            n = next(iter(flats.values())).numel()  # replicas hold equal parameters
            # chunk c is pipeline c's replica: it owns part c
            owned = {(d, c): padded_part(flat, n, parts, c) for (d, c), flat in flats.items()}
            whole = unpadded(transport.replica_gather(j, owned), n)
            for ps in params.values():
                assign_flat(ps, whole)


# ----------------------------------------------------------------------------- sharding


def _chunk_params(worker_chunks: Sequence[torch.nn.Module], chunk: int) -> list[torch.nn.Parameter]:
    return [p for p in worker_chunks[chunk].parameters() if p.requires_grad]


def _chunk_ranges(layout: MultiPipelineLayout, chunks: Sequence[torch.nn.Module]
                  ) -> Iterator[tuple[list[torch.nn.Parameter], int, int]]:
    """Per chunk: its trained parameters (the logical stage's flat order) and the flat range
    ``[lo, hi)`` its replica owns. Chunk ``c`` is pipeline ``c``'s replica of its logical stage,
    so it owns part ``c`` of the stage's flat parameter vector."""
    for chunk in range(layout.num_chunks):
        params = _chunk_params(chunks, chunk)
        lo, hi = shard_range(sum(p.numel() for p in params), layout.num_pipelines, chunk)
        yield params, lo, hi


def optimizer_shards(layout: MultiPipelineLayout, chunks: Sequence[torch.nn.Module],
                     named: Sequence[tuple[str, torch.nn.Parameter]]) -> dict[str, tuple[int, int]]:
    """Name -> the flat range of that parameter its replica owns (``StageAdamW(shards=...)``):
    each parameter's intersection with its chunk's part (:func:`_chunk_ranges`)."""
    name_of = {id(p): name for name, p in named}
    shards: dict[str, tuple[int, int]] = {}
    for params, lo, hi in _chunk_ranges(layout, chunks):
        for i, start, stop in owned_ranges(params, lo, hi):
            shards[name_of[id(params[i])]] = (start, stop)
    return shards


def _is_sharded(worker: StageWorker) -> bool:
    return worker.setup.optimizer.sharded


# ----------------------------------------------------------------------------- checkpoints


def _has_replica_shards(worker: StageWorker) -> bool:
    """AMDP's optimizer state is sharded over the replicas (at D = 2 one part: flat, but whole)."""
    return isinstance(worker.layout, MultiPipelineLayout) and _is_sharded(worker)


def _replica_ranges(worker: StageWorker) -> list[tuple[list[str], list[torch.nn.Parameter], int, int]]:
    """Per chunk of ``worker``: its parameters' names, the parameters and the owned flat range."""
    layout = worker.layout
    assert isinstance(layout, MultiPipelineLayout)
    name_of = {id(p): name for name, p in worker.setup.optimizer.named_parameters()}
    return [([name_of[id(p)] for p in params], params, lo, hi)
            for params, lo, hi in _chunk_ranges(layout, worker.setup.chunks)]


def whole_optimizer_states(transport: "Transport", workers: Sequence[StageWorker]) -> dict[int, dict] | None:
    """Device -> its optimizer's ``state_dict`` with every hosted logical stage's state whole
    (moments and half-precision masters in parameter shape, as the unsharded optimizer saves
    them); None when the optimizer state is not sharded over replicas (nothing to gather).

    Why gather at save: a checkpoint holding whole states is a plain one, so it loads into any
    layout (another pipeline size, split or schedule, AMDP or not) by parameter name, and
    :func:`owned_optimizer_state` cuts each replica's range back out bit for bit. A collective
    of the replica groups, in the order of :class:`ReplicaReduction` (increasing logical stage,
    every device alike): checkpoints are written by every device at the same drained boundary.
    """
    if not workers or not _has_replica_shards(workers[0]):
        return None
    layout = workers[0].layout
    assert isinstance(layout, MultiPipelineLayout)
    by_device = {w.stage: w for w in workers}
    states = {d: w.setup.optimizer.state_dict() for d, w in by_device.items()}
    ranges = {d: _replica_ranges(w) for d, w in by_device.items()}
    whole: dict[int, dict[str, dict[str, torch.Tensor]]] = {d: {} for d in by_device}
    for j, replicas in sorted(_local_replicas(layout, workers).items()):
        numel = sum(p.numel() for p in ranges[replicas[0][0]][replicas[0][1]][1])  # replicas hold equal parameters
        for kind in STATE_KINDS:
            owned = {(d, c): padded_part(owned_state(states[d]["params"], names, params, lo, hi, kind),
                                         numel, layout.num_pipelines, c)
                     for d, c in replicas for names, params, lo, hi in (ranges[d][c],)}
            # One pipeline (D = 2): the replica owns everything, nothing to exchange.
            parts = transport.replica_gather(j, owned) if has_replicas(layout) else list(owned.values())
            flat = unpadded(parts, numel)
            for d, c in replicas:
                add_whole_state(whole[d], kind, flat, ranges[d][c][0], ranges[d][c][1])
    return {d: {**{k: v for k, v in state.items() if k != "params"}, "params": whole[d]}
            for d, state in states.items()}


def owned_optimizer_state(worker: StageWorker, state: dict) -> dict:
    """A whole optimizer state (a gathered AMDP checkpoint, or one of a run without replicas)
    cut to the ranges this device's replicas own, for a sharded optimizer's ``load_state_dict``;
    ``state`` as it is for an unsharded one. Entries that are already a part (a checkpoint
    saved before the shards were gathered) stay as they are."""
    if not _has_replica_shards(worker):
        return state
    entries: dict[str, dict[str, torch.Tensor]] = {}
    for names, params, lo, hi in _replica_ranges(worker):
        entries.update(owned_entries(state["params"], names, params, lo, hi))
    return {**state, "params": entries}
