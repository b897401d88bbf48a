"""Our runtime vs ``torch.distributed.pipelining`` on the same megatron-core GPT stages.

The peer a PyTorch user would pick instead of this project runs **our own stage modules**
(``build_gpt_stage``: same layers, same init by global name, same mock data, same per-token
loss), so only the runtime differs. Each comparison runs as *interleaved pairs*: ours then the
peer, then the peer then ours, and so on, so load drifting on a shared host hits both alike;
every pair gives one throughput ratio (ours / peer), and the table reports the median ratio
with its spread (min-max) over the pairs, not a single run.

Per contender it also reports:
- the fraction of the bottleneck-stage bound: tokens per iteration over the busiest rank's
  pure compute time per iteration (forward + backward of its chunks on every micro-batch, no
  communication, timed in the peer's ranks after training; best of 3);
- peak RSS: the largest ``VmHWM`` over the rank processes of a run (our ranks are named
  ``megatron-rankN``; the peer's ranks are this script's worker processes).

Both sides: gloo, one thread per rank, fp32, AdamW, global-norm clipping at 1.0, ``m``
micro-batches per iteration, tokens/s from the median iteration time after warm-up. Each side
runs its defaults: ours the fused AdamW kernel, ``--host-malloc retain`` and ``--bind-cores
auto`` (each rank on its own core), the peer ``torch.optim.AdamW(foreach=True)``, the C
library's allocator and the scheduler's placement; ``--peer-adamw fused --peer-host-malloc
retain --peer-bind-cores auto`` gives the peer all three, so only the pipeline runtime differs.

    python benchmarks/peer_pipelining.py                                   # the issue's workload
    python benchmarks/peer_pipelining.py --pairs 5 --microbatches 4 8 --json peer.json
    python benchmarks/peer_pipelining.py --quick                           # tiny model, 1 pair (smoke)

Peer schedules: ``Schedule1F1B`` (vs our 1f1b and paci), ``ScheduleGPipe`` (vs gpipe),
``ScheduleInterleaved1F1B`` (vs interleaved-1f1b), ``ScheduleInterleavedZeroBubble`` and
``ScheduleZBVZeroBubble`` (vs zb-2p; both hold two chunks per rank), ``ScheduleZBVZeroBubble``
vs zb-v and ``ScheduleDualPipeV`` vs dualpipev: the same V placement on both sides (rank r holds
parts r and 2N - 1 - r). The peer's chunked schedules split evenly into their parts (its only
split); ours run our default, the balanced split per chunk (``--split balanced``: the V's rank 0
holds the embedding and the head, so it takes fewer layers), or the even one like the peer's
(``--split even``).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WORKLOAD = dict(num_layers=8, hidden=256, heads=4, seq=128, mbs=4, vocab=8192)
QUICK = dict(num_layers=4, hidden=64, heads=4, seq=32, mbs=2, vocab=512)

# ours -> the peer schedules it is compared with
COMPARISONS: dict[str, tuple[str, ...]] = {
    "1f1b": ("Schedule1F1B",),
    "gpipe": ("ScheduleGPipe",),
    "paci": ("Schedule1F1B",),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B",),
    "zb-2p": ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"),
    "zb-v": ("ScheduleZBVZeroBubble",),
    "dualpipev": ("ScheduleDualPipeV",),
}
# The peer's optimizer kernel, allocator policy and core binding (--peer-adamw, --peer-host-malloc,
# --peer-bind-cores).
PEER_OPTIONS: dict[str, str] = {"adamw": "foreach", "host_malloc": "system", "bind_cores": "none"}
MULTI_CHUNK = {"ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
V_SHAPE = {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}  # the peer's V placement
#: ours that hold several parts per stage (split per chunk: balanced by default, or even with --split even)
OURS_MULTI_CHUNK = {"interleaved-1f1b", "zb-v", "dualpipev"}


def model_flags(w: dict) -> list[str]:
    return ["--num-layers", str(w["num_layers"]), "--hidden-size", str(w["hidden"]),
            "--num-attention-heads", str(w["heads"]), "--seq-length", str(w["seq"]),
            "--vocab-size", str(w["vocab"]), "--micro-batch-size", str(w["mbs"]),
            "--hidden-dropout", "0", "--attention-dropout", "0", "--num-threads", "1", "--device", "cpu",
            "--mock-data", "--clip-grad", "1.0", "--lr", "1e-4", "--lr-decay-style", "constant"]


# --------------------------------------------------------------------------- measurement


@dataclass
class RunResult:
    tokens_per_s: float
    peak_rss_mb: float
    bound_tokens_per_s: float | None = None
    iteration_s: list[float] = field(default_factory=list)
    rank_cpu_s: list[float] = field(default_factory=list)  # user + system CPU of each rank process, whole run




class PeakRSS:
    """Polls ``VmHWM`` (the kernel's peak RSS) of every descendant of a process whose name
    matches, until stopped; the value only grows, so a sample shortly before exit suffices. Also
    each such process's CPU time (user + system, ``/proc/PID/stat``), which also only grows: the
    per-rank CPU spread says how evenly a layer split loads the ranks, whatever else the host runs."""

    def __init__(self, root_pid: int, match: str, period: float = 0.1) -> None:
        self.root, self.match, self.period = root_pid, match, period
        self.peak_kb: dict[int, int] = {}
        self.names: dict[int, str] = {}  # pid -> process name (``megatron-rankN`` for ours)
        self.cpu_ticks: dict[int, int] = {}  # pid -> utime + stime, clock ticks
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _children(self) -> list[int]:
        children: dict[int, list[int]] = collections.defaultdict(list)
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(entry))
        out, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(children.get(pid, []))
        return out

    def _poll(self) -> None:
        while not self._stop.is_set():
            for pid in self._children():
                try:
                    with open(f"/proc/{pid}/comm") as f:
                        name = f.read().strip()
                    if self.match not in name:
                        continue
                    with open(f"/proc/{pid}/status") as f:
                        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
                    with open(f"/proc/{pid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
                except (OSError, StopIteration, ValueError, IndexError):
                    continue
                self.cpu_ticks[pid] = max(self.cpu_ticks.get(pid, 0), ticks)
                self.peak_kb[pid] = max(self.peak_kb.get(pid, 0), hwm)
                self.names[pid] = name
            self._stop.wait(self.period)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak_kb.values(), default=0) / 1024

    def rank_cpu_s(self) -> list[float]:
        """CPU seconds of each matching process, by rank (name ``megatron-rankN``, else start order)."""
        tick = os.sysconf("SC_CLK_TCK")
        order = sorted(self.cpu_ticks, key=lambda pid: (self.names.get(pid, ""), pid))
        return [self.cpu_ticks[pid] / tick for pid in order]


def steady_median(times: list[float]) -> float:
    """Median iteration time after the first third (warm-up, allocator growth)."""
    return statistics.median(times[len(times) // 3:])


def train_ours(schedule: str, w: dict, stages: int, m: int, iters: int, tmp: Path,
               split: list[int] | None = None, timeline: Path | None = None,
               flags: tuple[str, ...] = ()) -> tuple[PeakRSS, list[dict]]:
    """Train our runtime on ``w``; return its ranks' peak RSS poller (stopped) and the iteration
    records. ``split``: per-stage layer counts (the peer's), None for a multi-chunk schedule (even
    split; a V schedule's 2N parts as the peer's V); ``timeline``: trace into this directory; ``flags``: more trainer flags."""
    log = tmp / f"ours-{schedule}-{m}-{time.monotonic_ns()}.jsonl"
    extra: list[str] = [*flags]
    if schedule == "interleaved-1f1b":
        extra += ["--num-layers-per-virtual-pipeline-stage", str(w["num_layers"] // (2 * stages))]
    if split is not None:
        extra += ["--pipeline-layer-split", *map(str, split)]
    if timeline is not None:
        extra += ["--trace-dir", str(timeline)]
    cmd = [sys.executable, str(REPO / "pretrain_gpt.py"), *model_flags(w), *extra,
           "--pipeline-model-parallel-size", str(stages), "--pipeline-schedule", schedule,
           "--global-batch-size", str(w["mbs"] * m), "--train-iters", str(iters),
           "--log-interval", "1", "--log-json", str(log)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_clean_env())
    rss = PeakRSS(proc.pid, "megatron-rank")
    out, _ = proc.communicate()
    rss.stop()
    if proc.returncode != 0:
        raise SystemExit(f"ours {schedule} m={m} failed:\n{out[-3000:]}")
    return rss, [json.loads(line) for line in log.read_text().splitlines() if '"iteration"' in line]


def run_ours(schedule: str, w: dict, stages: int, m: int, iters: int, tmp: Path,
             split: list[int] | None = None, timeline: Path | None = None, flags: tuple[str, ...] = ()) -> RunResult:
    """One timed run of our runtime (arguments as for :func:`train_ours`)."""
    rss, records = train_ours(schedule, w, stages, m, iters, tmp, split, timeline, flags)
    tokens = w["mbs"] * m * w["seq"]
    times = [tokens / r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
    return RunResult(tokens / steady_median(times), rss.stop(), iteration_s=times, rank_cpu_s=rss.rank_cpu_s())


def run_peer(schedule: str, w: dict, stages: int, m: int, iters: int, tmp: Path,
             split: list[int] | None = None, timeline: Path | None = None) -> RunResult:
    """One run of the peer; ``split`` as for :func:`run_ours` (None: even over its parts);
    ``timeline``: write its ranks' op spans to ``timeline/peer.json``."""
    out_file = tmp / f"peer-{schedule}-{m}-{time.monotonic_ns()}.json"
    port = _free_port()
    procs = []
    for rank in range(stages):
        env = dict(_clean_env(), RANK=str(rank), WORLD_SIZE=str(stages), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        cmd = [sys.executable, __file__, "--worker", schedule, "--worker-out", str(out_file),
               "--worker-m", str(m), "--worker-iters", str(iters), "--worker-workload", json.dumps(w),
               "--worker-split", json.dumps(split), "--worker-timeline", str(timeline or ""),
               "--worker-options", json.dumps(PEER_OPTIONS)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    monitors = [PeakRSS(p.pid, "python") for p in procs]
    outputs = [p.communicate()[0] for p in procs]
    peak = max(mon.stop() for mon in monitors)
    cpu = [sum(mon.rank_cpu_s()) for mon in monitors]  # one worker process tree per rank
    if any(p.returncode != 0 for p in procs):
        raise SystemExit(f"peer {schedule} m={m} failed:\n" + "\n".join(o[-3000:] for o in outputs))
    result = json.loads(out_file.read_text())
    tokens = w["mbs"] * m * w["seq"]
    return RunResult(tokens / steady_median(result["iteration_s"]), peak,
                     bound_tokens_per_s=tokens / max(result["compute_s"]), iteration_s=result["iteration_s"],
                     rank_cpu_s=cpu)


def _clean_env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "MEGATRON_ASYNC_LAUNCHED")
    return {k: v for k, v in os.environ.items() if k not in drop} | {"PYTHONWARNINGS": "ignore"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- the peer's ranks


def _virtual_stages(schedule: str, rank: int, world: int) -> list[int]:
    """The model parts this rank holds: one for single-chunk schedules, rank and rank + world
    for the interleaved ones (loop placement), rank and 2·world − 1 − rank for ZBV and
    DualPipeV (V shape)."""
    from megatron.interop.torch_pipelining import TORCH_SCHEDULES, rank_parts  # shared with the CSV bridge (#44)

    return rank_parts(TORCH_SCHEDULES[schedule], rank, world)


def peer_worker(schedule: str, m: int, iters: int, w: dict, out_file: str, split: list[int] | None = None,
                timeline: str = "", options: dict | None = None) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.tasks.gpt import gpt_model_args
    from megatron.trainer.models.gpt import build_gpt_stage
    from megatron.trainer.models.stage import split_layers
    from megatron.trainer.loop.training import _init_megatron_parallel_state

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    options = options or PEER_OPTIONS
    if options.get("bind_cores", "none") == "auto":  # our --bind-cores default; before any thread starts
        from megatron.trainer.launch.core_binding import bind_cores
        bind_cores("auto", True, rank, world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    _init_megatron_parallel_state()
    config = parse_run_plan(model_flags(w) + ["--pipeline-model-parallel-size", "1"])
    model_args, seed = gpt_model_args(config), config.training.seed
    parts = 2 * world if schedule in MULTI_CHUNK else world
    layers = split_layers(w["num_layers"], parts, split)
    labels: collections.deque = collections.deque()

    class Chunk(torch.nn.Module):
        """Our stage behind the peer's tensor-in/tensor-out interface: the first part embeds
        tokens, the last returns the per-token loss (labels fed in micro-batch order)."""

        def __init__(self, part: int) -> None:
            super().__init__()
            self.stage = build_gpt_stage(model_args, layers[part], pre_process=part == 0,
                                         post_process=part == parts - 1, seed=seed, device="cpu")
            self.first, self.last = part == 0, part == parts - 1

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            batch: dict[str, torch.Tensor] = {}
            if self.first:
                batch = {"tokens": x, "position_ids": torch.arange(x.shape[1]).expand_as(x)}
                x = None  # type: ignore[assignment]
            if self.last:
                batch["labels"] = labels.popleft()
            return self.stage(x, batch)

    mine = _virtual_stages(schedule, rank, world)
    chunks = [Chunk(v) for v in mine]
    hidden = torch.empty(w["seq"], w["mbs"], w["hidden"], requires_grad=True)  # grads flow back
    # Shapes given up front: the peer's shape inference would run a forward (and eat a label).
    stages = [pipelining.PipelineStage(
        c, v, parts, torch.device("cpu"),
        input_args=torch.zeros(w["mbs"], w["seq"], dtype=torch.long) if c.first else hidden,
        output_args=torch.empty(w["mbs"], w["seq"]) if c.last else hidden) for c, v in zip(chunks, mine)]

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output * target).sum() / target.sum()

    sched_cls = getattr(pipelining, schedule)
    sched = sched_cls(stages if schedule in MULTI_CHUNK else stages[0], n_microbatches=m, loss_fn=loss_fn)
    params = [p for c in chunks for p in c.parameters()]
    if options["host_malloc"] == "retain":  # the allocator policy our ranks run with (--host-malloc)
        from megatron.trainer.launch.host_allocator import apply_host_malloc
        apply_host_malloc("retain")
    kernel = {"foreach": dict(foreach=True), "fused": dict(fused=True)}[options["adamw"]]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **kernel)

    from megatron.trainer.data.mock import MockGPTData

    from benchmarks.harness.peer_timeline import PeerRecorder, cpu_ms, now_ms

    recorder = PeerRecorder()
    if timeline:
        for stage in stages:
            recorder.wrap(stage)

    data = MockGPTData(w["seq"], w["vocab"], seed)
    holds_first, holds_last = 0 in mine, parts - 1 in mine
    times = []
    for it in range(iters):
        samples = [data.sample(it * m * w["mbs"] + i) for i in range(m * w["mbs"])]
        tokens = torch.stack([s["tokens"] for s in samples])
        if holds_last:
            labels.extend(torch.stack([s["labels"] for s in samples]).chunk(m))
        target = torch.stack([s["loss_mask"] for s in samples]) if holds_last else None
        start = time.perf_counter()
        recorder.begin()
        opt.zero_grad(set_to_none=True)
        step_args = (tokens,) if holds_first else ()
        sched.step(*step_args, target=target)
        step_start, step_cpu = now_ms(), cpu_ms()
        sq = torch.stack([p.grad.pow(2).sum() for p in params if p.grad is not None]).sum()
        dist.all_reduce(sq)  # global-norm clipping across stages, as ours does
        coef = min(1.0, 1.0 / (float(sq.sqrt()) + 1e-6))
        if coef < 1.0:
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], coef)
        opt.step()
        recorder.step(step_start, step_cpu)
        times.append(time.perf_counter() - start)

    compute = _compute_time(chunks, m, w, data, labels)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, compute)
    spans: list = [None] * world
    dist.all_gather_object(spans, {"iterations": recorder.iterations, "cpu_iterations": recorder.cpu_iterations,
                                   "cpu_ms": recorder.cpu_ms})
    if rank == 0:
        Path(out_file).write_text(json.dumps({"iteration_s": times, "compute_s": gathered}))
        if timeline:
            Path(timeline).mkdir(parents=True, exist_ok=True)
            (Path(timeline) / "peer.json").write_text(json.dumps(spans))
    dist.destroy_process_group()


def _compute_time(chunks, m: int, w: dict, data, labels: collections.deque) -> float:
    """Pure compute of this rank per iteration: forward + backward of each chunk on m
    micro-batches, no communication (best of 3)."""
    import torch

    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _mb in range(m):
            for chunk in chunks:
                if chunk.first:
                    x = torch.stack([data.sample(i)["tokens"] for i in range(w["mbs"])])
                else:
                    x = torch.randn(w["seq"], w["mbs"], w["hidden"], requires_grad=True)
                if chunk.last:
                    labels.append(torch.stack([data.sample(i)["labels"] for i in range(w["mbs"])]))
                out = chunk(x)
                grad = torch.ones_like(out) / out.numel() if chunk.last else torch.randn_like(out)
                out.backward(grad)
        best = min(best, time.perf_counter() - start)
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
    return best


# --------------------------------------------------------------------------- the comparison


def layer_split(w: dict, stages: int, how: str) -> list[int]:
    """Per-stage layer counts of a one-part-per-stage run: our default (``balanced``: the
    cost model's split, what ``pretrain_gpt.py`` picks without ``--pipeline-layer-split``) or
    ``even``. Both sides of a single-chunk comparison get these counts, so only the runtime differs."""
    if how == "even":
        return [w["num_layers"] // stages] * stages
    from megatron.trainer.plan.parse import parse_run_plan

    config = parse_run_plan(model_flags(w) + ["--pipeline-model-parallel-size", str(stages), "--pipeline-schedule",
                                                "1f1b", "--global-batch-size", str(w["mbs"] * stages)])
    return list(config.layers.counts or [w["num_layers"] // stages] * stages)


def compare(ours: str, peer: str, w: dict, stages: int, m: int, pairs: int, iters: int, tmp: Path,
            split: list[int], timeline: Path | None = None, how: str = "balanced") -> dict:
    """``split``: the per-stage layer counts of both sides when both hold one part per stage
    (ours gets it for zb-2p too; the peer's two-chunk schedules split evenly over 2N parts);
    ``how``: our chunked schedules' split (``balanced``: our default, per chunk; ``even``)."""
    ratios, ours_runs, peer_runs = [], [], []
    ours_split = None if ours in OURS_MULTI_CHUNK else split
    ours_flags = ("--pipeline-partition", "even") if ours in OURS_MULTI_CHUNK and how == "even" else ()
    peer_split = None if peer in MULTI_CHUNK else split
    for pair in range(pairs):
        order = [("ours", ours), ("peer", peer)] if pair % 2 == 0 else [("peer", peer), ("ours", ours)]
        got = {}
        where = timeline / f"{ours}-{peer}-m{m}-pair{pair}" if timeline is not None else None
        for side, name in order:
            if side == "ours":
                got[side] = run_ours(name, w, stages, m, iters, tmp, ours_split, where, ours_flags)
            else:
                got[side] = run_peer(name, w, stages, m, iters, tmp, peer_split, where)
        ours_runs.append(got["ours"])
        peer_runs.append(got["peer"])
        ratios.append(got["ours"].tokens_per_s / got["peer"].tokens_per_s)
        print(f"  pair {pair}: {ours} {got['ours'].tokens_per_s:.0f} tok/s, {peer} {got['peer'].tokens_per_s:.0f} "
              f"tok/s, ratio {ratios[-1]:.3f} (load {os.getloadavg()[0]:.1f})", flush=True)
        if where is not None:
            print_timeline(where, iters)
    bound = statistics.median(r.bound_tokens_per_s for r in peer_runs)
    return {
        "ours": ours, "peer": peer, "m": m, "split": ours_split if ours_split is not None else f"{how} per chunk",
        "ratios": ratios,
        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "ours_tokens_per_s": statistics.median(r.tokens_per_s for r in ours_runs),
        "peer_tokens_per_s": statistics.median(r.tokens_per_s for r in peer_runs),
        "bound_tokens_per_s": bound,
        "ours_of_bound": statistics.median(r.tokens_per_s for r in ours_runs) / bound,
        "peer_of_bound": statistics.median(r.tokens_per_s for r in peer_runs) / bound,
        "ours_peak_rss_mb": max(r.peak_rss_mb for r in ours_runs),
        "peer_peak_rss_mb": max(r.peak_rss_mb for r in peer_runs),
        "ours_rank_cpu_s": [statistics.median(c) for c in zip(*(r.rank_cpu_s for r in ours_runs))],
        "peer_rank_cpu_s": [statistics.median(c) for c in zip(*(r.rank_cpu_s for r in peer_runs))],
    }


def print_timeline(where: Path, iters: int) -> None:
    """Both sides' per-rank breakdown of one pair (:mod:`benchmarks.harness.peer_timeline`)."""
    from benchmarks.harness.peer_timeline import HEADER, ours_iterations, report

    skip = iters // 3
    peer = json.loads((where / "peer.json").read_text())
    print(HEADER)
    for line in report("ours", ours_iterations(where), skip):
        print(line)
    for line in report("peer", {r: d["iterations"] for r, d in enumerate(peer)}, skip,
                       {r: d["cpu_ms"] for r, d in enumerate(peer)}):
        print(line)
    for line in report("peer cpu", {r: d["cpu_iterations"] for r, d in enumerate(peer)}, skip):
        print(line, flush=True)  # the same ops on the thread's CPU clock: what they cost unloaded


def _cpu_text(cpu: list[float]) -> str:
    """Per-rank CPU seconds and the busiest rank's over the least busy's (the split's imbalance)."""
    if not cpu or min(cpu) <= 0:
        return "-"
    return f"{' / '.join(f'{c:.1f}' for c in cpu)} ({max(cpu) / min(cpu):.2f}x)"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--schedules", nargs="+", default=list(COMPARISONS), choices=list(COMPARISONS))
    p.add_argument("--quick", action="store_true", help="tiny model, one pair, 4 iterations (a smoke run)")
    p.add_argument("--split", choices=("balanced", "even"), default="balanced",
                   help="layer split of both sides of one-part-per-stage pairs (balanced: our default's "
                        "counts), and of ours on chunked layouts (the peer's chunks split evenly)")
    p.add_argument("--timeline", default=None, metavar="DIR",
                   help="trace both sides into DIR and print each pair's per-rank breakdown")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-m", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-iters", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-workload", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-split", default="null", help=argparse.SUPPRESS)
    p.add_argument("--worker-timeline", default="", help=argparse.SUPPRESS)
    p.add_argument("--worker-options", default="null", help=argparse.SUPPRESS)
    p.add_argument("--peer-adamw", choices=("foreach", "fused"), default="foreach",
                   help="the peer's torch.optim.AdamW kernel (foreach: torch's default on GPU; fused: the kernel "
                        "our --adam-kernel default runs, for a runtime-only comparison)")
    p.add_argument("--peer-host-malloc", choices=("system", "retain"), default="system",
                   help="the peer ranks' C allocator policy (retain: what our --host-malloc default applies)")
    p.add_argument("--peer-bind-cores", choices=("none", "auto"), default="none",
                   help="the peer ranks' core binding (auto: what our --bind-cores default applies)")
    a = p.parse_args(argv)
    if a.worker:
        peer_worker(a.worker, a.worker_m, a.worker_iters, json.loads(a.worker_workload), a.worker_out,
                    json.loads(a.worker_split), a.worker_timeline, json.loads(a.worker_options))
        return
    w = QUICK if a.quick else WORKLOAD
    PEER_OPTIONS.update(adamw=a.peer_adamw, host_malloc=a.peer_host_malloc, bind_cores=a.peer_bind_cores)
    pairs, iters = (1, 4) if a.quick else (a.pairs, a.iters)
    rows = []
    split = layer_split(w, a.stages, a.split)
    timeline = Path(a.timeline) if a.timeline else None
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for m in a.microbatches:
            for ours in a.schedules:
                for peer in COMPARISONS[ours]:
                    print(f"{ours} vs {peer}, m={m}:", flush=True)
                    rows.append(compare(ours, peer, w, a.stages, m, pairs, iters, Path(tmp), split, timeline, a.split))
    print(f"\nN={a.stages}, workload {w}, layer split {split} ({a.split}), peer {PEER_OPTIONS}, {pairs} interleaved pairs, "
          f"{iters} iterations per run, {time.monotonic() - began:.0f} s in all\n")
    print("| ours | peer | m | ratio ours/peer median (min-max) | ours tok/s | peer tok/s | "
          "ours / bound | peer / bound | peak RSS MB ours | peak RSS MB peer | CPU s per rank ours | CPU s per rank peer |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ours']} | {r['peer']} | {r['m']} | {r['ratio_median']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) | "
              f"{r['ours_tokens_per_s']:.0f} | {r['peer_tokens_per_s']:.0f} | {r['ours_of_bound']:.3f} | "
              f"{r['peer_of_bound']:.3f} | {r['ours_peak_rss_mb']:.0f} | {r['peer_peak_rss_mb']:.0f} | "
              f"{_cpu_text(r['ours_rank_cpu_s'])} | {_cpu_text(r['peer_rank_cpu_s'])} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
