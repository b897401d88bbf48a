"""The distributed runtime equals the emulator bitwise for asynchronous schedules, and a
non-finite gradient on one stage skips that stage's update without stopping training."""
from __future__ import annotations

import json
import math

import pytest
import torch

from tests.async_helpers import emulate, final_params, run_pretrain, tiny_args

CASES = {
    "async-1f1b-N4": (4, "async-1f1b", 1, []),
    "paci-N4-a2": (4, "paci", 2, []),
    "paci-N4-a4": (4, "paci", 4, []),
    "paci-N3-a3-uneven": (3, "paci", 3, ["--num-layers", "4", "--pipeline-layer-split", "2", "1", "1"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_distributed_runtime_equals_emulator_bitwise(megatron_world1, tmp_path, case):
    num_stages, schedule, a, extra = CASES[case]
    # Dropout on: each stage's RNG stream must also match between the executors.
    argv = tiny_args(num_stages, schedule, a, 6, "--hidden-dropout", "0.1", "--attention-dropout", "0.1", *extra)
    records, dist_params = run_pretrain(argv, tmp_path / "dist")
    emu_log = tmp_path / "emu.jsonl"
    workers = emulate([*argv, "--pipeline-executor", "emulator", "--log-json", str(emu_log)])
    emu_records = [json.loads(line) for line in emu_log.read_text().splitlines()]
    assert [r["loss"] for r in records] == [r["loss"] for r in emu_records]
    assert [r["drift_max"] for r in records] == [r["drift_max"] for r in emu_records]
    emu_params = final_params(workers)
    assert dist_params.keys() == emu_params.keys()
    for name, value in dist_params.items():
        assert torch.equal(value, emu_params[name]), name


def test_nonfinite_gradient_skips_only_that_stage_and_training_continues(tmp_path):
    argv = tiny_args(2, "paci", 2, 6, "--inject-nonfinite-grad", "1:2")
    records, _ = run_pretrain(argv, tmp_path / "run")
    skipped = [r["skipped_updates"] for r in records]
    assert skipped[2] == [0, 1], skipped  # iteration 3 = local update 2 of stage 1
    # the logged norm is the last stage's: not finite when it skipped, not a made-up 0.0
    norms = [r["grad_norm"] for r in records]
    assert math.isnan(norms[2]) and all(math.isfinite(g) and g > 0 for i, g in enumerate(norms) if i != 2), norms
    assert all(s == [0, 0] for i, s in enumerate(skipped) if i != 2)
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[-1]["iteration"] == 6


def test_skipped_update_leaves_that_stage_one_version_behind(megatron_world1, keep_update_history):
    workers = emulate(tiny_args(2, "paci", 2, 4, "--pipeline-executor", "emulator", "--inject-nonfinite-grad", "1:1"))
    assert [w.version for w in workers] == [4, 3]
    assert [e["skipped"] for e in workers[1].update_log] == [False, True, False, False]
    for w in workers:
        for p in w.setup.optimizer.parameters():
            assert torch.isfinite(p).all()
