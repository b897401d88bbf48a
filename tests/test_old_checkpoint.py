"""A checkpoint written by an older main still loads, and the run continues as if never stopped.

``tests/fixtures/checkpoint_49222bb/`` was saved by main at 49222bb (before the trainer's
floors were reordered, #41) with::

    python pretrain_gpt.py --pipeline-executor emulator --pipeline-model-parallel-size 2 \\
        --num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --vocab-size 32 \\
        --micro-batch-size 1 --global-batch-size 4 --train-iters 4 --log-interval 1 \\
        --save DIR --save-interval 2 --exit-interval 2 --num-threads 1 --seed 7

The reference is today's run of the same flags without stopping: resuming the old checkpoint
at iteration 2 must give iterations 3 and 4 bit for bit (weights, AdamW moments, the RNG and
the data position all come from the file), and the same final weights.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from tests.async_helpers import run_pretrain

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_49222bb"
FLAGS = [
    "--pipeline-executor", "emulator", "--pipeline-model-parallel-size", "2", "--num-layers", "2",
    "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8", "--vocab-size", "32",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4", "--log-interval", "1",
    "--num-threads", "1", "--seed", "7",
]


def test_checkpoint_of_49222bb_resumes_bitwise(tmp_path: Path) -> None:
    saved = tmp_path / "old"
    shutil.copytree(FIXTURE, saved)  # the run may not write into the repository
    resumed, resumed_params = run_pretrain([*FLAGS, "--load", str(saved)], tmp_path / "resumed")
    straight, straight_params = run_pretrain(FLAGS, tmp_path / "straight")
    assert [r["iteration"] for r in resumed] == [3, 4], "the old checkpoint did not resume at iteration 2"
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight][2:]
    assert resumed_params.keys() == straight_params.keys()
    changed = [n for n in straight_params if not torch.equal(resumed_params[n], straight_params[n])]
    assert not changed, f"parameters differ from the uninterrupted run: {changed[:5]}"
