"""``--sequence-parallel`` (issue 15, item 1): TP = 2 x PP = 2 with the sequence split over the
TP group trains like TP = 1 x PP = 2, on gloo.

Sequence parallelism changes where every norm and the activations between stages live
(``[s/2, b, h]`` per TP rank), adds an all-gather before and a reduce-scatter after each TP
linear (gloo's ``all_gather_into_tensor`` / ``reduce_scatter_tensor``) and makes the norms'
and row-parallel biases' gradients partial per TP rank (summed over the TP group before the
norm). None of that may change the training: the reference is the emulator at TP = 1 (no TP
code at all), compared like tests/test_tensor_parallel_runtime.py does (losses, grad norms
<= 1e-5 relative, final parameters gathered over the TP group). The B/W-split schedule
(ZB-2P) checks that the sequence-parallel matmuls defer their weight gradients correctly;
the RoPE + RMSNorm + SwiGLU run checks RoPE's length on a shard and the RMSNorm weights.
One launch of 4 forked gloo ranks for all runs. The one-line refusals (T = 1, a sequence length
not divisible by T, BERT) are in tests/test_tensor_parallel_runtime.py's REFUSED list.
"""
from __future__ import annotations

import pytest

from tests.test_tensor_parallel_runtime import _assert_same_training, _launch_tp2

pytestmark = [pytest.mark.usefixtures("megatron_world1"), pytest.mark.numerics]

SP = ["--sequence-parallel"]
RUNS = [
    ("1f1b", ["--num-layers", "2"]),
    ("zb-2p", ["--num-layers", "2", "--zb-costs", "1,1,1,0"]),
    ("paci", ["--num-layers", "2"]),
    ("1f1b", ["--num-layers", "2", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu"]),
]


def test_sequence_parallel_tp2_pp2_trains_like_tp1(tmp_path):
    results = _launch_tp2([(schedule, [*flags, *SP]) for schedule, flags in RUNS], tmp_path)
    for (schedule, flags), result in zip(RUNS, results):
        _assert_same_training(result, schedule, flags, tmp_path)


def test_sequence_parallel_with_data_parallel_sums_after_the_dp_average(tmp_path):
    """DP = 2 x PP = 2 x TP = 2 (8 ranks): the TP sum of the sequence-parallel gradients comes
    after the DP average, which with --overlap-grad-reduce writes the gradients back only at the
    step (and with --use-distributed-optimizer only this rank's range of them). Reference: the same run without sequence parallelism (itself checked against TP = 1)."""
    flags = ["--num-layers", "2", "--global-batch-size", "8"]
    ref, *with_sp = _launch_tp2([("1f1b", flags), ("1f1b", [*flags, *SP]),
                                 ("1f1b", [*flags, *SP, "--overlap-grad-reduce"]),
                                 ("1f1b", [*flags, *SP, "--use-distributed-optimizer"])], tmp_path, ranks=8)
    for records, _ in with_sp:
        for ours, want in zip(records, ref[0]):
            for key in ("loss", "grad_norm"):
                if key in want:
                    assert ours[key] == pytest.approx(want[key], rel=1e-5), (key, ours, want)
        assert len(records) == len(ref[0])


def test_sequence_parallel_dropout_resumes_bitwise(tmp_path):
    """With dropout, the sequence-parallel region draws from megatron's RNG tracker (a CPU one
    here, seeded per TP rank); the worker's RNG state carries it, so a run saved at iteration 2
    and resumed gives the losses of the uninterrupted run bit for bit."""
    ckpt = str(tmp_path / "ckpt")
    flags = ["--num-layers", "2", "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--train-iters", "4", *SP]
    whole, first, resumed = _launch_tp2([("1f1b", flags),
                                         ("1f1b", [*flags, "--exit-interval", "2", "--save", ckpt, "--save-interval", "2"]),
                                         ("1f1b", [*flags, "--load", ckpt])], tmp_path)
    losses = [[(r["iteration"], r["loss"]) for r in records if "loss" in r] for records, _ in (whole, first, resumed)]
    assert [i for i, _ in losses[0]] == [1, 2, 3, 4]
    assert losses[1] + losses[2] == losses[0]
