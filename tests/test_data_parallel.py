"""Data-parallel replicas of a stage all-reduce gradients within the stage's DP group:
PP=2 x DP=2 must train like PP=2 x DP=1 on the same global batch (up to summation order). Dropout is off: replicas share their
stage's dropout seed, as in Megatron-LM, so their masks differ from one replica's stream."""
from __future__ import annotations

import pytest

from tests.async_helpers import assert_trains_like, emulated_reference, run_pretrain, tiny_args

pytestmark = pytest.mark.numerics  # re-run by .ci/run under a second ATEN_CPU_CAPABILITY


@pytest.mark.parametrize("schedule", ["1f1b", "paci"])
def test_two_replicas_per_stage_match_one_replica(megatron_world1, tmp_path, schedule):
    """The reference is one replica in the emulator (bitwise the runtime's, checked elsewhere);
    the replicas sum their gradients in another order, so losses and parameters are compared
    within the tolerances tests/adam_bounds.py derives from the reference's own Adam steps."""
    no_dropout = ["--hidden-dropout", "0", "--attention-dropout", "0"]
    # Same a = 2 micro-batches per update on every replica (PACI's weight-version semantics
    # depend on a): one replica with micro-batches of 2 samples vs two replicas of 1 sample.
    base = [*tiny_args(2, schedule, 2, 4, *no_dropout), "--micro-batch-size", "2", "--global-batch-size", "4"]
    ref = emulated_reference(base, tmp_path / "dp1.jsonl")
    dp2_args = [*tiny_args(2, schedule, 2, 4, *no_dropout), "--data-parallel-size", "2", "--global-batch-size", "4"]
    dp2, p2 = run_pretrain(dp2_args, tmp_path / "dp2")
    assert [r["consumed_samples"] for r in dp2] == [r["consumed_samples"] for r in ref.records]
    assert_trains_like(dp2, p2, ref, keys=("loss",), context=f"{schedule} DP=2: ")
