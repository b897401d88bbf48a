"""``--host-malloc``: with ``retain`` a re-allocated tensor reuses warm heap pages.

Measured by the kernel's count of minor page faults in a fresh process (the policy changes
the process's C allocator for good, so not in the test process): a 40 MB tensor is above
glibc's largest adaptive mmap threshold (32 MB), so with the C library's defaults every
allocation maps fresh zero pages and faults them in; with ``retain`` (heap up to 64 MiB) the
heap settles after a few allocations (posix_memalign's slack leaves a few freed copies behind)
and re-allocation then costs no faults.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron.trainer.launch import host_allocator
from megatron.trainer.launch.host_allocator import apply_host_malloc

REPO = Path(__file__).resolve().parent.parent
FAULTS_PER_ALLOCATION = """
import resource, sys, torch
from megatron.trainer.launch.host_allocator import apply_host_malloc
print(apply_host_malloc(sys.argv[1]), file=sys.stderr)
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(12):
    torch.empty(10_000_000).fill_(1.0)  # 40 MB, freed at once
before = faults()
for _ in range(20):
    torch.empty(10_000_000).fill_(1.0)
print((faults() - before) / 20)
"""


def faults_per_allocation(policy: str) -> float:
    out = subprocess.run([sys.executable, "-c", FAULTS_PER_ALLOCATION, policy], capture_output=True, text=True,
                         check=True, cwd=REPO)
    return float(out.stdout.strip())


@pytest.mark.skipif(host_allocator._mallopt() is None, reason="needs glibc's mallopt")
def test_retain_stops_page_faults_of_reallocated_tensors() -> None:
    system, retain = faults_per_allocation("system"), faults_per_allocation("retain")
    assert system > 5000, system  # ~9800 pages of 4 KiB mapped and faulted per allocation
    assert retain < 100, retain


def test_retain_without_glibc_says_it_did_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_allocator, "_mallopt", lambda: None)
    assert apply_host_malloc("retain").startswith("system (retain needs glibc")
    assert apply_host_malloc("system").startswith("system")


def test_the_flag_reaches_the_banner_arguments() -> None:
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.loop.run_banner import argument_lines

    config = parse_run_plan(["--mock-data", "--host-malloc", "system"])
    from megatron.trainer.loop.training import prepare_host

    import torch
    threads = torch.get_num_threads()
    try:
        config = prepare_host(config, 1)
    finally:
        torch.set_num_threads(threads)
    lines = argument_lines(config)
    assert any(line.split()[0] == "host_malloc" and line.endswith(" system") for line in lines)
    assert any(line.split()[0] == "host_malloc_effect" and "system" in line for line in lines)
