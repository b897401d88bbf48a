"""Per-rank peak RSS and activation-meter peak of our runtime on the peer benchmark's workload.

``benchmarks/peer_pipelining.py`` reports one peak RSS per run (the largest over its ranks), which
hides which stage sets it; freeing memory on one stage (issue 18, item 5) shows up here. Each run
trains ``pretrain_gpt.py`` with 2 gloo ranks on ``peer_pipelining.WORKLOAD`` (8 layers, hidden
256, seq 128, micro-batch 4, vocab 8192, fp32, m micro-batches per iteration) and prints, per
rank, the kernel's peak RSS (``VmHWM``, polled) and the worker's activation meter peak (bytes
autograd saved, plus what W keeps) from the run's last ``--log-json`` record. Peak RSS counts
pages, not timing, so it can be taken on a loaded host; runs are repeated because the allocator's
fragmentation (and the receive buffers posted ahead) vary a few MB between runs.

    OMP_NUM_THREADS=1 python benchmarks/investigations/rank_peak_rss.py --schedules 1f1b paci zb-2p --repeats 3
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.peer_pipelining import WORKLOAD, train_ours  # noqa: E402


def run(schedule: str, m: int, iters: int, tmp: Path) -> tuple[list[float], list[float]]:
    """(peak RSS MB per rank, activation meter peak MB per stage) of one run."""
    rss, records = train_ours(schedule, WORKLOAD, 2, m, iters, tmp, flags=("--log-activation-memory",))
    by_rank = sorted((rss.names[pid], kb / 1024) for pid, kb in rss.peak_kb.items())
    return [mb for _, mb in by_rank], list(records[-1]["peak_activation_mb"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedules", nargs="+", default=["1f1b", "paci", "zb-2p"])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    print("| schedule | run | peak RSS MB rank 0 / rank 1 | activation meter peak MB stage 0 / stage 1 |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in a.schedules:
            for i in range(a.repeats):
                rss, act = run(schedule, a.microbatches, a.iters, Path(tmp))
                print(f"| {schedule} | {i + 1} | {' / '.join(f'{v:.0f}' for v in rss)} | "
                      f"{' / '.join(f'{v:.1f}' for v in act)} |", flush=True)


if __name__ == "__main__":
    main()
