"""Memory stays flat over a run: no rank and no emulated stage keeps something per iteration.

Memory is sampled inside each process by ``benchmarks/investigations/soak_probe.py`` at update boundaries,
after a full ``gc.collect()`` (which also empties CPython's free lists): the live heap (glibc's
in-use bytes plus pymalloc's allocated blocks, exact to the byte) and RSS.

The distributed test trains a tiny GPT on 2 gloo ranks for ``ITERS`` iterations and bounds
each rank's RSS growth over the last ``WINDOW`` iterations (least-squares slope x ``WINDOW``)
by one micro-batch's saved activations, measured by the run itself (the logged peak
activation bytes over the peak number of micro-batches in flight). A runtime that keeps every
sent activation or gradient until the segment ends (what reaping gloo sends by
``is_completed()`` did) grows by ``m`` boundary tensors per iteration, several micro-batches'
worth over the window. The live heap must grow by less than ``LIVE_BOUND`` bytes per iteration.

The probe runs every process with glibc's per-thread cache off, because ``mallinfo2`` counts
the chunks that cache holds as in use, and the caches fill slowly (this was the decaying
growth of 18 down to 0.3 B/iteration on the 1F1B ranks that looked like a leak inside torch): the
thread-cache test shows the tunable takes freed chunks out of the live heap, and the
distributed test checks that every rank ran with it.

The leak test shows that the live-heap slope is not blind: the emulator, run in this process
with the probe's deliberate leak of one ``bytes(64)`` per update, must show at least 64 B
per update more than the same run without it.

The emulator test counts the Python objects the garbage collector tracks at two logged
iterations ``WINDOW`` apart, after warm-up: the count is exactly flat on a healthy run, and
anything kept per update or per logged iteration (an ``update_log`` entry per stage, a
logger record) adds at least one object per four iterations.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import pytest

from benchmarks.investigations.soak import REPO, pretrain_cmd, run_probed, slope, steady
from benchmarks.investigations.soak_probe import NO_TCACHE, Probe, probed, read, tcache_off_env
from tests.async_helpers import emulate, tiny_args

MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "2", "--seq-length", "64",
         "--vocab-size", "64", "--micro-batch-size", "2", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--num-threads", "1", "--lr", "1e-3", "--lr-warmup-iters", "1"]
# The last WINDOW iterations are measured. The first ITERS - WINDOW are warm-up: the heap
# grows in steps for a few hundred iterations while the allocator's free chunks settle into
# the run's pattern, then stays put.
ITERS = 400
WINDOW = 100
# Bytes per iteration the live heap may grow by in the distributed test. A healthy rank is still
# warming up at iteration 300-400 (17-47 B/iteration measured; a few B/iteration after 1000);
# keeping one small tensor per iteration (a report, a received buffer) costs well over 512.
LIVE_BOUND = 512


@pytest.mark.slow
def test_distributed_ranks_memory_does_not_grow_over_100_iterations(tmp_path) -> None:
    cmd = pretrain_cmd("paci", 2, 2, ITERS, tmp_path / "log.jsonl", [*MODEL, "--log-activation-memory"], emulator=False)
    series, _ = run_probed(cmd, tmp_path / "probe", ["--every", "5"], timeout_s=300)
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [s.name for s in series] == ["megatron-rank0", "megatron-rank1"], [s.name for s in series]
    assert all(s.tcache_off for s in series), [s.tunables for s in series]
    for stage, s in enumerate(series):
        # one micro-batch's saved activations on this stage, as the run measured them
        per_microbatch = max(r["peak_activation_mb"][stage] / r["peak_inflight_microbatches"][stage]
                             for r in records) * 2**20
        resident, live = (steady(s.column(c), ITERS - WINDOW, ITERS) for c in ("rss", "live"))
        assert len(resident) >= 15, f"{s.name}: only {len(resident)} samples in the last {WINDOW} iterations"
        growth, live_slope = slope(resident) * WINDOW, slope(live)
        print(f"{s.name}: RSS growth over {WINDOW} iterations {growth / 2**10:.0f} KiB (one micro-batch's "
              f"activations {per_microbatch / 2**10:.0f} KiB); live heap {live_slope:.1f} B/iteration")
        assert growth <= per_microbatch, (
            f"{s.name}: RSS grew {growth / 2**10:.0f} KiB over the last {WINDOW} iterations, more than one "
            f"micro-batch's activations ({per_microbatch / 2**10:.0f} KiB)")
        assert live_slope <= LIVE_BOUND, f"{s.name}: the live heap grows by {live_slope:.1f} B per iteration"


# Frees 7 chunks of each of 33 size classes the thread cache holds (520-1032 bytes) and prints
# by how much glibc's in-use bytes stayed above where they were before the mallocs.
_FREED_CHUNKS = """
import ctypes
from benchmarks.investigations.soak_probe import c_heap_in_use
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
sizes = [size for size in range(1032, 512, -16) for _ in range(7)]
chunks = (ctypes.c_void_p * len(sizes))()  # allocated before the first reading
before = c_heap_in_use()
for i, size in enumerate(sizes):
    chunks[i] = libc.malloc(size)
for chunk in chunks:
    libc.free(chunk)
print(c_heap_in_use() - before, sum(sizes))
"""


def _child(code: str, tcache: bool, *args: str) -> list[str]:
    """Run ``code`` in a fresh interpreter (glibc reads its tunables at start-up only) with
    the thread cache on (glibc's default of 7 chunks per size class) or off (as the probe
    runs); the words it printed."""
    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env = {**plain, "GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"} if tcache else tcache_off_env(plain)
    assert env is not None
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120, check=True).stdout.split()


def test_freed_chunks_leave_the_live_heap_with_the_thread_cache_off() -> None:
    """With glibc's default thread cache, freed small chunks stay counted as in use (that is
    what the probe must not measure); with the probe's tunable they leave at once."""
    cached, freed = map(int, _child(_FREED_CHUNKS, True))
    off = int(_child(_FREED_CHUNKS, False)[0])
    print(f"freed {freed} B in 231 chunks; still counted in use: {cached} B with the thread cache, {off} B without")
    assert cached >= freed // 2, f"the thread cache kept only {cached} of {freed} freed bytes counted (test not sensitive)"
    assert abs(off) <= 256, f"with {NO_TCACHE}, {off} B of {freed} freed bytes still count as in use"


def test_tcache_tunable_joins_other_tunables() -> None:
    env = tcache_off_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=1"})
    assert env == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=1:{NO_TCACHE}"}
    assert tcache_off_env(env) is None


def _probed_slope(out, leak_bytes: int, updates: int = 200) -> float:
    """Live-heap slope (B/update) of a synthetic workload under the probe, over its second half.

    Each update allocates and drops what a training step does at small scale (tensors, tuples
    built from generators, which CPython's free lists keep, a cyclic structure only the collector
    frees); the probe's ``leak_bytes`` is the only thing kept."""
    import torch

    out.mkdir()
    probe = Probe(out, every=4, leak_bytes=leak_bytes)
    try:
        for update in range(updates):
            x = torch.randn(64, 64, requires_grad=True)
            (x @ x).sum().backward()
            shapes = [tuple(d for d in t.shape) for t in (x, x.grad)] + [tuple(range(update % 20))]
            cycle: dict = {"shapes": shapes}
            cycle["self"] = cycle
            del x, shapes, cycle
            probe.update(update)
    finally:
        gc.unfreeze()  # the probe froze this process's objects at its first sample
    [series] = read(out)
    return slope(steady(series.column("live"), updates // 2, updates))


_CLEAN_AND_LEAKING = """
import sys
from pathlib import Path
from tests.test_memory_flat import _probed_slope
print(_probed_slope(Path(sys.argv[1]) / "clean", 0), _probed_slope(Path(sys.argv[1]) / "leak", 64))
"""


def test_live_heap_slope_resolves_one_byte_and_catches_a_leak(tmp_path) -> None:
    """In a child with the thread cache off, as the probe runs every process: in pytest's own
    process (cache on) the clean slope read 1.05 B/update in one run of five, 0.00 in the others."""
    clean, leaking = map(float, _child(_CLEAN_AND_LEAKING, False, str(tmp_path))[-2:])
    print(f"live heap: {clean:.2f} B/update clean, {leaking:.2f} with a leak of bytes(64) per update")
    assert abs(clean) <= 1, f"the live heap of a workload that keeps nothing moves by {clean:.2f} B per update"
    assert leaking >= 64, f"a leak of bytes(64) per update shows as {leaking:.2f} B per update only"


def test_emulator_keeps_nothing_per_iteration(megatron_world1, monkeypatch) -> None:
    from megatron.trainer.loop.logger import TrainingLogger

    first, last, interval = 80, 80 + WINDOW, 4
    objects: dict[int, int] = {}
    log_update = TrainingLogger.log_update

    def counted(self, update, reports):  # noqa: ANN001 - the logger's own signature
        log_update(self, update, reports)
        if update + 1 in (first, last):
            gc.collect()
            objects[update + 1] = len(gc.get_objects())

    monkeypatch.setattr(TrainingLogger, "log_update", counted)
    workers = emulate(tiny_args(2, "paci", 2, last, "--pipeline-executor", "emulator", "--log-interval", str(interval)))
    # the logs hold the last logging interval only (tests opt in to more: keep_update_history)
    assert all(len(w.update_log) <= interval for w in workers), [len(w.update_log) for w in workers]
    grown = objects[last] - objects[first]
    print(f"Python objects: {objects[first]} at iteration {first}, {objects[last]} at {last}")
    assert grown < WINDOW // 4, f"the emulator holds {grown} more Python objects after {WINDOW} more iterations"


def test_update_history_is_kept_when_asked(megatron_world1, keep_update_history) -> None:
    workers = emulate(tiny_args(2, "paci", 2, 6, "--pipeline-executor", "emulator", "--log-interval", "2"))
    assert [[e["update"] for e in w.update_log] for w in workers] == [list(range(6))] * 2


_RECORDED_ENTRIES = """
import os, pickle, sys
import torch, torch.distributed as dist
from megatron.trainer.launch import flight_recorder
flight_recorder.disable_unless_requested()
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
norms = [torch.zeros(1)]
for _ in range(10):  # the synchronous step's grad-norm all-gather, once per iteration
    dist.all_gather(norms, torch.ones(1))
print(len(pickle.loads(torch._C._distributed_c10d._dump_fr_trace())["entries"]))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("user_size, entries", [(None, 0), ("2000", 10)])
def test_flight_recorder_keeps_no_collectives_unless_asked(user_size, entries, monkeypatch, tmp_path) -> None:
    """torch's c10d flight recorder kept a ~0.5 KB entry per collective (2000 by default),
    growing the logging rank's heap for its first ~2000 iterations; the trainer turns it off
    before creating process groups, unless the user set a buffer size (then it is kept)."""
    import subprocess
    import sys

    from megatron.trainer.launch.flight_recorder import BUFFER_SIZE_VARS

    for var in BUFFER_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    if user_size is not None:
        monkeypatch.setenv(BUFFER_SIZE_VARS[0], user_size)
    # A file store, not a probed free port: another test's process can take the port first.
    proc = subprocess.run([sys.executable, "-c", _RECORDED_ENTRIES, str(tmp_path / "store")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) == entries, proc.stdout
