"""Point-to-point on gloo: what recycled receive buffers and batched P2P cost, load-robustly.

Three measurements, each as interleaved A/B blocks (A, B, B, A, ...) reported as the median
ratio B/A with its spread (min-max over the pairs), so load drifting on a shared host hits
both sides alike:

1. ``buffers``: providing one receive buffer in this process. *fresh* is what
   ``P2PChannel.post`` did before (``torch.empty`` per receive), *pooled* is
   :class:`~megatron.pipeline.runtime.transport.recv_buffers.ReceiveBuffers` (take, lend,
   drop); both then write every byte, as a receive does. Measured in thread CPU time and minor
   page faults per receive (the kernel zeroing fresh pages is what a new ``mmap``-sized buffer
   costs).
2. ``batch``: one 1F1B steady-state exchange between two gloo ranks (send an activation, receive
   a gradient of the same size, wait for both), as two ``isend``/``irecv`` calls or as one
   ``batch_isend_irecv`` of the two on one group. Measured in process CPU time (gloo works in
   its own threads) and wall time per exchange.
3. ``runtime``: the distributed runtime (forked gloo ranks) on a small GPT, 1f1b, with
   ``P2PChannel.reuse_receive_buffers`` on vs off; the ranks' CPU time and minor page faults
   (``RUSAGE_CHILDREN`` around each run) and the run's wall time.

    OMP_NUM_THREADS=1 python benchmarks/investigations/p2p_comm.py                  # all three, about 3 min loaded
    OMP_NUM_THREADS=1 python benchmarks/investigations/p2p_comm.py --only buffers batch --pairs 9
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

# The workload: activations [seq 128, micro-batch 4, hidden 256] fp32 = 512 KiB.
ACT_SHAPE = (128, 4, 256)


def _pairs(measure_a: Callable[[], dict[str, float]], measure_b: Callable[[], dict[str, float]],
           pairs: int) -> dict[str, tuple[float, float, float, float, float]]:
    """Interleaved A/B blocks; per metric: (median A, median B, median ratio B/A, min, max)."""
    a_runs, b_runs = [], []
    for i in range(pairs):
        first, second = (measure_a, measure_b) if i % 2 == 0 else (measure_b, measure_a)
        x, y = first(), second()
        a, b = (x, y) if i % 2 == 0 else (y, x)
        a_runs.append(a)
        b_runs.append(b)
    out = {}
    for key in a_runs[0]:
        ratios = [b[key] / a[key] for a, b in zip(a_runs, b_runs) if a[key] > 0]
        out[key] = (statistics.median(r[key] for r in a_runs), statistics.median(r[key] for r in b_runs),
                    statistics.median(ratios) if ratios else float("nan"),
                    min(ratios, default=float("nan")), max(ratios, default=float("nan")))
    return out


def _print(title: str, a: str, b: str, result: dict[str, tuple[float, float, float, float, float]]) -> None:
    print(f"\n{title}: {b} / {a}, median of interleaved pairs (spread)")
    print(f"  {'metric':<28} {a:>12} {b:>12} {'ratio':>7}  spread")
    for key, (ma, mb, r, lo, hi) in result.items():
        print(f"  {key:<28} {ma:12.4g} {mb:12.4g} {r:7.3f}  {lo:.3f}-{hi:.3f}")


# -- 1. receive buffers in this process -----------------------------------------------
def _buffers_block(pooled: bool, shape: tuple[int, ...], n: int) -> dict[str, float]:
    from megatron.pipeline.runtime.transport.recv_buffers import ReceiveBuffers

    pool = ReceiveBuffers(reuse=pooled)
    cpu = torch.device("cpu")
    held: list[torch.Tensor] = []
    faults0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.thread_time()
    for i in range(n):
        buf = pool.take(shape, torch.float32, cpu)
        buf.fill_(float(i))  # the receive writes every byte
        held.append(pool.lend(buf))
        if len(held) > 2:  # a stage holds a few received tensors at a time
            held.pop(0)
    t1, faults1 = time.thread_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    return {"cpu_us_per_receive": (t1 - t0) / n * 1e6, "page_faults_per_receive": (faults1 - faults0) / n}


def bench_buffers(pairs: int, n: int) -> None:
    for shape in (ACT_SHAPE, (512, 8, 512)):
        mib = torch.Size(shape).numel() * 4 / 2**20
        result = _pairs(lambda: _buffers_block(False, shape, n), lambda: _buffers_block(True, shape, n), pairs)
        _print(f"receive buffer {list(shape)} fp32 ({mib:g} MiB), {n} receives per block", "fresh", "pooled", result)


# -- 2. batched vs unbatched exchange on two gloo ranks -------------------------------
def _exchange_block(rank: int, batched: bool, n: int) -> dict[str, float]:
    import torch.distributed as dist

    peer = 1 - rank
    send = torch.randn(ACT_SHAPE)
    recv = torch.empty(ACT_SHAPE)
    dist.barrier()
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        if batched:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)])
        else:
            works = [dist.isend(send, peer), dist.irecv(recv, peer)]
        for work in works:
            work.wait()
    c1, w1 = time.process_time(), time.perf_counter()
    return {"process_cpu_us_per_exchange": (c1 - c0) / n * 1e6, "wall_us_per_exchange": (w1 - w0) / n * 1e6}


def _exchange_rank(rank: int, store: str, pairs: int, n: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        _exchange_block(rank, False, 10)  # warm up the pair's connection
        result = _pairs(lambda: _exchange_block(rank, False, n), lambda: _exchange_block(rank, True, n), pairs)
        if rank == 0:
            coalesces = dist.group.WORLD._get_backend(torch.device("cpu")).supports_coalescing
            with contextlib.redirect_stdout(io.StringIO()) as text:
                _print(f"1F1B exchange on gloo (send + receive {list(ACT_SHAPE)} fp32), rank 0, {n} per block",
                       "unbatched", "batched", result)
                print(f"  gloo supports_coalescing: {coalesces} (False: batch_isend_irecv issues the same "
                      "isend/irecv calls in a loop)")
            Path(out).write_text(text.getvalue())
    finally:
        dist.destroy_process_group()


def bench_batch(pairs: int, n: int) -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "result.txt")
        mp.start_processes(_exchange_rank, args=(os.path.join(directory, "store"), pairs, n, out), nprocs=2,
                           join=True, start_method="spawn")
        print(Path(out).read_text(), end="")


# -- 3. the runtime with and without reuse --------------------------------------------
RUNTIME_ARGS = [
    "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
    "--micro-batch-size", "4", "--vocab-size", "1024", "--global-batch-size", "32",
    "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b", "--train-iters", "4",
    "--lr", "1e-4", "--log-interval", "4", "--num-threads", "1",
]


def _runtime_block(reuse: bool) -> dict[str, float]:
    from megatron.pipeline.runtime.transport.distributed import P2PChannel
    from megatron.trainer.loop.training import pretrain
    from megatron.trainer.tasks.gpt import GPTTask

    P2PChannel.reuse_receive_buffers = reuse
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = pretrain(GPTTask(), RUNTIME_ARGS, script=str(REPO / "pretrain_gpt.py"))
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        raise RuntimeError(f"pretrain exited {code}")
    return {"ranks_cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
            "ranks_minor_page_faults": after.ru_minflt - before.ru_minflt, "wall_s": wall}


def bench_runtime(pairs: int) -> None:
    from megatron.trainer.launch.launcher import fork_is_safe

    if not fork_is_safe():
        raise SystemExit("p2p_comm: the launcher cannot fork its ranks here (the switch would not reach them)")
    _runtime_block(True)  # warm-up: the first run pays one-time imports in the ranks
    result = _pairs(lambda: _runtime_block(False), lambda: _runtime_block(True), pairs)
    _print("runtime, GPT 4 layers h256 s128 b4 V1024, 2 stages 1f1b m=8, 4 iterations (RUSAGE_CHILDREN)",
           "no reuse", "reuse", result)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=("buffers", "batch", "runtime"), default=("runtime", "buffers", "batch"))
    p.add_argument("--pairs", type=int, default=7, help="interleaved A/B pairs per measurement")
    p.add_argument("--receives", type=int, default=400, help="receives per block (buffers)")
    p.add_argument("--exchanges", type=int, default=200, help="exchanges per block (batch)")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"load average at start: {os.getloadavg()}")
    if "runtime" in args.only:  # first: forking needs a process without helper threads
        bench_runtime(max(3, args.pairs // 2))
    if "buffers" in args.only:
        bench_buffers(args.pairs, args.receives)
    if "batch" in args.only:
        bench_batch(args.pairs, args.exchanges)
    print(f"\nload average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
