"""``--profile`` on a CPU host: what the runtime's transport and time-shared cores cost.

Why a second measurement: the profile's emulator run passes messages inside one process (its
P2P time is about 0.004 ms), while the distributed runtime on a CPU host sends them through gloo
between processes. There a message costs CPU on both ends (it is copied through the kernel
twice, and threads wake for it: about 1 ms for a 128 KiB activation between ops on this project's
2-core host) and takes longer to arrive; AMDP's replicas and data-parallel replicas move their
gradients through gloo collectives; and when a run has more ranks than the host has cores, the
ranks that time-share cores pay more per message. None of this shows in one process.

What is measured (two processes over gloo and a file store, one thread each, as the runtime's
CPU ranks run):

* **A message** (:attr:`LinkCosts.p2p`, :attr:`LinkCosts.message_cpu`): ``ROUND_TRIPS``
  ping-pongs of one activation-sized tensor; half the median round trip is the one-way time.
  Then as many round trips each after a few milliseconds of matrix products, as a pipeline
  sends between ops: the CPU time both processes spent (every thread, ``time.process_time``)
  less the products' own (``time.thread_time``), over the messages, is ``message_cpu`` (twice
  what back-to-back ping-pongs cost: the threads and caches have gone cold). ``p2p`` is the
  one-way time less ``message_cpu`` (the simulator adds ``t_comm`` after the sender's
  ``t_send``, so the message arrives a one-way time after its op), at least 0. The same with
  as many pairs at once as cores (twice as many processes as cores) is ``shared_message_cpu``.
* **A collective** (:attr:`LinkCosts.reduce_ms_per_byte`): the median time of an all-gather of
  ``collective_bytes`` per rank, over the bytes one rank sends.

Not measured: a time-sliced core's own slowdown (cache refills after each switch). A stand-in
layer timed in twice as many busy processes as cores took 2-8 % more CPU, but charged to every
op of the processor-sharing replay it made the N = 4 prediction worse in each of four measured
passes on this project's 2-core host (within 10 %: 29, 23, 20, 20 of 29 with it; 29, 28, 29,
29 without): the runtime's ranks block in receives between ops, so they do not time-slice as
two always-busy processes do (``docs/planning.md``).
"""
from __future__ import annotations

import multiprocessing
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROUND_TRIPS = 200
WARMUP = 20
COLLECTIVE_REPEATS = 15
COMPUTE_WIDTH = 256  # between two round trips, COMPUTE_STEPS products of this size (a few ms)
COMPUTE_STEPS = 40
BLOCK = 20  # round trips per CPU reading; the median block is taken (a host hiccup hits one)


@dataclass(frozen=True)
class LinkCosts:
    """Milliseconds (see the module docstring for how each is measured)."""

    p2p: float
    message_cpu: float
    shared_message_cpu: float
    reduce_ms_per_byte: float


def _link_rank(pair: int, rank: int, store: str, message_elements: int, collective_elements: int,
               start_together: Any, results: Any) -> None:
    """One of the two processes of pair ``pair`` of the message (and, with ``collective_elements``,
    the collective) measurement; every pair's processes start timing together."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    start_together.wait()
    peer = 1 - rank
    message = torch.zeros(message_elements)

    def round_trip() -> None:
        if rank == 0:
            dist.send(message, peer)
            dist.recv(message, peer)
        else:
            dist.recv(message, peer)
            dist.send(message, peer)

    for _ in range(WARMUP):
        round_trip()
    trips = []
    for _ in range(ROUND_TRIPS):
        start = time.perf_counter()
        round_trip()
        trips.append(time.perf_counter() - start)
    # the CPU per message between computations, as in a pipeline (caches and threads gone cold)
    weight = torch.randn(COMPUTE_WIDTH, COMPUTE_WIDTH)
    block = torch.randn(COMPUTE_WIDTH, COMPUTE_WIDTH)
    blocks = []  # CPU s per round trip of each block of BLOCK round trips, less the products'
    for _ in range(ROUND_TRIPS // BLOCK):
        compute = 0.0
        cpu = time.process_time()
        for _ in range(BLOCK):
            start = time.thread_time()
            for _ in range(COMPUTE_STEPS):
                block = torch.tanh(block @ weight)
            compute += time.thread_time() - start
            round_trip()
        blocks.append((time.process_time() - cpu - compute) / BLOCK)
    cpu = statistics.median(blocks) * ROUND_TRIPS
    spans = [0.0]
    if collective_elements:
        mine = torch.zeros(collective_elements)
        gathered = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(gathered, mine)
        spans = []
        for _ in range(COLLECTIVE_REPEATS):
            dist.barrier()
            start = time.perf_counter()
            dist.all_gather(gathered, mine)
            spans.append(time.perf_counter() - start)
    results.put((pair, rank, cpu, statistics.median(trips), statistics.median(spans)))
    dist.destroy_process_group()


CONTEXT = multiprocessing.get_context("spawn")  # a fresh interpreter: no thread or state of ours


def _run(target: Any, args: list[tuple], timeout: float = 300.0) -> list[Any]:
    """Run ``target(*a, results)`` in one spawned process per ``a``; their results."""
    results = CONTEXT.Queue()
    processes = [CONTEXT.Process(target=target, args=(*a, results), daemon=True) for a in args]
    for p in processes:
        p.start()
    try:
        out = [results.get(timeout=timeout) for _ in processes]
    finally:
        for p in processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if any(p.exitcode for p in processes):
        raise RuntimeError(f"a link-profile process failed (exit codes {[p.exitcode for p in processes]})")
    return out


def _pairs(pairs: int, message_bytes: int, collective_bytes: int) -> list[tuple]:
    """Each process's (pair, rank, CPU s, median round trip s, median collective s) of ``pairs``
    pairs measuring at once."""
    with tempfile.TemporaryDirectory() as tmp:
        barrier = CONTEXT.Barrier(2 * pairs)
        return sorted(_run(_link_rank, [(p, r, str(Path(tmp) / f"store{p}"), max(1, message_bytes // 4),
                                         collective_bytes // 4, barrier) for p in range(pairs) for r in range(2)]))


def _message_cpu(ranks: list[tuple]) -> float:
    """CPU ms per message, both ends, the median over the pairs."""
    per_pair: dict[int, float] = {}
    for pair, _, cpu, _, _ in ranks:
        per_pair[pair] = per_pair.get(pair, 0.0) + cpu
    return statistics.median(per_pair.values()) / (2 * ROUND_TRIPS) * 1e3


def measure_link(message_bytes: int, collective_bytes: int, cores: int) -> LinkCosts:
    """Measure :class:`LinkCosts` on this host (module docstring); ``cores``: the host's usable cores."""
    ranks = _pairs(1, message_bytes, collective_bytes)
    trip, collective = ranks[0][3], ranks[0][4]
    message_cpu = _message_cpu(ranks)
    shared_message_cpu = _message_cpu(_pairs(cores, message_bytes, 0))
    return LinkCosts(p2p=max(0.0, trip / 2 * 1e3 - message_cpu), message_cpu=message_cpu,
                     shared_message_cpu=shared_message_cpu,
                     reduce_ms_per_byte=collective * 1e3 / max(1, collective_bytes))
