"""The per-rank memory estimate against measured peak RSS, and the up-front refusals it drives.

The reference is independent of the estimate: the kernel's peak resident set (``VmHWM``) of
each rank process of a real ``pretrain_gpt.py`` run, polled by ``benchmarks.peer_pipelining``'s
``PeakRSS``. The estimate compared is the one the run itself printed in its banner (what the
memory check used), so the flags-to-estimate path is tested end to end.

Tolerance 25 % (the issue's): the estimate is analytic (parameter counts and the cost model's
saved activations) with one measured constant, the host heap factor, whose calibration runs
spread +-16 % around it (``megatron/trainer/plan/memory_estimate.py``); the rest is the
baseline's variation between the launcher, which the estimate reads, and a forked rank (about
30 MB of ~350 MB) and allocator noise between runs (a few MB, ``benchmarks/investigations/rank_peak_rss.py``).
The configurations differ from the calibration ones (other sizes, schedules, PP, recompute) and
keep model state and activations at about half or more of each process's peak.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from async_helpers import REPO

from benchmarks.peer_pipelining import PeakRSS

TOLERANCE = 0.25  # the bound; derivation in the module docstring
MIB = 2 ** 20
BANNER = re.compile(r"memory per rank \(estimate, MiB, cpu\) per stage: \[([\d, ]+)\] \| .* baseline ([\d,]+)")


@dataclass(frozen=True)
class Config:
    name: str
    flags: tuple[str, ...]
    single_process: bool  # the emulator: one process holds every stage


MODEL = ("--num-layers", "4", "--num-attention-heads", "8", "--vocab-size", "2048", "--train-iters", "2",
         "--log-interval", "1", "--device", "cpu")
CONFIGS = [
    Config("1f1b PP 2, two ranks", (*MODEL, "--pipeline-model-parallel-size", "2", "--hidden-size", "384",
                                     "--seq-length", "256", "--micro-batch-size", "4", "--global-batch-size", "8"),
           single_process=False),
    Config("gpipe PP 2, emulator", (*MODEL, "--pipeline-executor", "emulator", "--pipeline-schedule", "gpipe",
                                    "--pipeline-model-parallel-size", "2", "--hidden-size", "256", "--seq-length",
                                    "256", "--micro-batch-size", "4", "--global-batch-size", "8"),
           single_process=True),
    Config("1 rank, selective recompute", (*MODEL, "--hidden-size", "512", "--seq-length", "128",
                                           "--micro-batch-size", "8", "--global-batch-size", "8",
                                           "--recompute-granularity", "selective"),
           single_process=True),
]


def _measure(config: Config) -> tuple[list[float], list[float], float]:
    """(estimated MiB per process, measured peak MiB per process, seconds) of one run."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(REPO / "pretrain_gpt.py"), *config.flags], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rss = PeakRSS(proc.pid, "" if config.single_process else "megatron-rank", period=0.05)
    out, _ = proc.communicate(timeout=240)
    rss.stop()
    assert proc.returncode == 0, out[-3000:]
    match = BANNER.search(out)
    assert match, out[-3000:]
    per_stage = [float(v.replace(",", "")) for v in match[1].split(", ")]
    if config.single_process:  # one process, one baseline: the stages' model state and activations add up
        baseline = float(match[2].replace(",", ""))
        return [sum(per_stage) - baseline * (len(per_stage) - 1)], [rss.peak_kb[proc.pid] / 1024], \
            time.monotonic() - start
    by_rank = sorted((rss.names[pid], kb / 1024) for pid, kb in rss.peak_kb.items())
    return per_stage, [mb for _, mb in by_rank], time.monotonic() - start


def test_estimate_matches_measured_peak_rss() -> None:
    """Three configurations, each rank (or the emulator's process) within 25 % of its VmHWM."""
    with ThreadPoolExecutor(len(CONFIGS)) as pool:  # peak RSS counts pages, not time: runs may overlap
        results = list(pool.map(_measure, CONFIGS))
    report = []
    for config, (estimated, measured, seconds) in zip(CONFIGS, results):
        assert len(estimated) == len(measured), (config.name, estimated, measured)
        for rank, (e, m) in enumerate(zip(estimated, measured)):
            report.append(f"{config.name} rank {rank}: estimate {e:.0f} MiB, measured {m:.0f} MiB, "
                          f"ratio {e / m:.3f} ({seconds:.0f} s)")
    print("\n".join(report))
    for estimated, measured, _ in results:
        for e, m in zip(estimated, measured):
            assert abs(e - m) <= TOLERANCE * m, "\n".join(report)
