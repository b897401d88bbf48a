"""Memory stays flat over a run: no rank and no emulated stage keeps something per iteration.

The distributed test trains a tiny GPT on 2 gloo ranks for ``ITERS`` iterations while
``benchmarks/soak.py``'s sampler reads each rank's RSS from /proc, and bounds each rank's
growth over the last ``WINDOW`` iterations (the median slope between pairs of samples x
``WINDOW``: steady growth counts, a one-off heap extension at a new peak does not) by one
micro-batch's saved activations, measured by the run itself (the logged peak activation
bytes over the peak number of micro-batches in flight). A runtime that keeps every sent
activation or gradient until the segment ends (what reaping gloo sends by ``is_completed()``
did) grows by ``m`` boundary tensors per iteration, several micro-batches' worth over the window.

The emulator test counts the Python objects the garbage collector tracks at two logged
iterations ``WINDOW`` apart, after warm-up: the count is exactly flat on a healthy run, and
anything kept per update or per logged iteration (an ``update_log`` entry per stage, a
logger record) adds at least one object per four iterations.
"""
from __future__ import annotations

import gc
import json

import pytest

from benchmarks.soak import median_slope, pretrain_cmd, sample_run
from tests.async_helpers import emulate, tiny_args

MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "2", "--seq-length", "64",
         "--vocab-size", "64", "--micro-batch-size", "2", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--num-threads", "1", "--lr", "1e-3", "--lr-warmup-iters", "1"]
# The last WINDOW iterations are measured. The first ITERS - WINDOW are warm-up: the heap
# grows in steps for a few hundred iterations while the allocator's free chunks settle into
# the run's pattern (and Python's free lists fill up to their caps), then stays put.
ITERS = 400
WINDOW = 100


@pytest.mark.slow
def test_distributed_ranks_rss_does_not_grow_by_a_microbatch_over_100_iterations(tmp_path) -> None:
    log = tmp_path / "log.jsonl"
    run = sample_run(pretrain_cmd("paci", 2, 2, ITERS, log, MODEL, emulator=False), log, ranks=True,
                     interval_s=0.05, timeout_s=300)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(run.series) == 2, run.series.keys()
    for stage, (name, points) in enumerate(sorted(run.series.items())):
        # one micro-batch's saved activations on this stage, as the run measured them
        per_microbatch = max(r["peak_activation_mb"][stage] / r["peak_inflight_microbatches"][stage]
                             for r in records) * 2**20
        window = [(x, y) for x, y in points if ITERS - WINDOW <= x < ITERS]
        assert len(window) >= 20, f"{name}: only {len(window)} RSS samples in the last {WINDOW} iterations"
        growth = median_slope(window) * WINDOW
        print(f"{name}: RSS growth over {WINDOW} iterations {growth / 2**10:.0f} KiB, "
              f"one micro-batch's activations {per_microbatch / 2**10:.0f} KiB")
        assert growth <= per_microbatch, (
            f"{name}: RSS grew {growth / 2**10:.0f} KiB over the last {WINDOW} iterations, more than one "
            f"micro-batch's activations ({per_microbatch / 2**10:.0f} KiB)")


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
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
norms = [torch.zeros(1)]
for _ in range(10):  # the synchronous step's grad-norm all-gather, once per iteration
    dist.all_gather(norms, torch.ones(1))
print(len(pickle.loads(torch._C._distributed_c10d._dump_fr_trace())["entries"]))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("user_size, entries", [(None, 0), ("2000", 10)])
def test_flight_recorder_keeps_no_collectives_unless_asked(user_size, entries, monkeypatch) -> None:
    """torch's c10d flight recorder kept a ~0.5 KB entry per collective (2000 by default),
    growing the logging rank's heap for its first ~2000 iterations; the trainer turns it off
    before creating process groups, unless the user set a buffer size (then it is kept)."""
    import subprocess
    import sys

    from megatron.trainer.launch.flight_recorder import BUFFER_SIZE_VARS
    from megatron.trainer.launch.launcher import free_port

    for var in BUFFER_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    if user_size is not None:
        monkeypatch.setenv(BUFFER_SIZE_VARS[0], user_size)
    out = subprocess.run([sys.executable, "-c", _RECORDED_ENTRIES, str(free_port())], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert int(out.split()[-1]) == entries, out
