"""Activation recompute (``--recompute-*``): exactness, RNG, B/W split, asynchronous schedules.

The reference is always the same run without recompute (emulator, tiny GPT, fp32):

* synchronous schedules (1f1b, gpipe, zb-h1 with its B/W split, interleaved-1f1b) train to the
  same losses and final parameters with full (uniform and block) and selective recompute;
* with dropout on, the recomputation repeats the forward's masks (same losses and parameters);
* recompute really runs: saved-activation memory drops, and every recomputed layer runs its
  forward exactly twice per micro-batch, also under the B/W split (once in F, once in B: W
  reuses the inputs B recomputed);
* asynchronous PACI: full recompute reads the weights current at backward time, so it departs
  from the run without recompute; ``--recompute-stash-weights`` brings it back exactly;
  selective recompute (core attention has no weights) never departs;
* the distributed runtime equals the emulator with recompute on.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.async_helpers import emulate, final_params, run_pretrain, tiny_args

pytestmark = pytest.mark.usefixtures("megatron_world1")

FULL_UNIFORM = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"]
FULL_BLOCK = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]
SELECTIVE = ["--recompute-activations"]
MODES = {"full-uniform": FULL_UNIFORM, "full-block": FULL_BLOCK, "selective": SELECTIVE}
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
DROPOUT = ["--hidden-dropout", "0.2", "--attention-dropout", "0.2"]
SCHEDULE_FLAGS = {
    "1f1b": [], "gpipe": [], "zb-h1": [],
    # 2 stages x 2 chunks of 2 layers: uniform units of 2 layers still fit every chunk
    "interleaved-1f1b": ["--num-layers", "8", "--num-layers-per-virtual-pipeline-stage", "2"],
    # V placement: 2 stages x 2 V chunks of 2 layers (a split B/W schedule and a fused-BW one)
    "v-half": ["--num-layers", "8"], "dualpipev": ["--num-layers", "8"],
}


def train(schedule: str, tmp_path: Path, *extra: str, iters: int = 3) -> tuple[list[float], dict, list]:
    """Losses, final parameters and workers of a 2-stage, 4-layer emulator run."""
    log = tmp_path / f"log{len(list(tmp_path.glob('log*')))}.jsonl"
    argv = [*tiny_args(2, schedule, 4, iters, "--num-layers", "4", *SCHEDULE_FLAGS.get(schedule, []), *extra),
            "--pipeline-executor", "emulator", "--log-json", str(log), "--log-activation-memory"]
    workers = emulate(argv)
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    return losses, final_params(workers), workers


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def assert_same_training(got: tuple, want: tuple, tol: float = 1e-6) -> None:
    assert got[0] == pytest.approx(want[0], rel=tol, abs=tol)
    assert max_difference(got[1], want[1]) <= tol


@pytest.mark.parametrize("schedule", list(SCHEDULE_FLAGS))
def test_recompute_equals_none_for_synchronous_schedules(schedule: str, tmp_path: Path) -> None:
    reference = train(schedule, tmp_path, *NO_DROPOUT)
    peaks = {}
    for mode, flags in MODES.items():
        run = train(schedule, tmp_path, *NO_DROPOUT, *flags)
        assert_same_training(run, reference)
        peaks[mode] = max(w.meter.run_peak_bytes for w in run[2])
    none = max(w.meter.run_peak_bytes for w in reference[2])
    assert peaks["full-uniform"] < peaks["selective"] < none, (peaks, none)  # recompute really kept less


def test_dropout_masks_repeat_in_the_recomputation(tmp_path: Path) -> None:
    reference = train("1f1b", tmp_path, *DROPOUT)
    assert max_difference(reference[1], train("1f1b", tmp_path, *NO_DROPOUT)[1]) > 1e-4  # dropout is on
    for flags in MODES.values():
        assert_same_training(train("1f1b", tmp_path, *DROPOUT, *flags), reference)


def test_bw_split_recomputes_once_in_b(tmp_path: Path) -> None:
    """zb-h1: every layer runs forward twice per micro-batch (F, and the recomputation in B);
    W runs the deferred weight gradients on the inputs B recomputed."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    calls = {"n": 0}

    def count(module: torch.nn.Module, _inputs: object) -> None:
        if isinstance(module, TransformerLayer) and module.training:
            calls["n"] += 1

    handle = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        run = train("zb-h1", tmp_path, *DROPOUT, *FULL_BLOCK, "--recompute-num-layers", "2", iters=2)
    finally:
        handle.remove()
    layers, microbatches = 4, 4 * 2
    assert calls["n"] == 2 * layers * microbatches
    assert_same_training(run, train("zb-h1", tmp_path, *DROPOUT, iters=2))


def test_async_recompute_reads_current_weights_unless_stashed(tmp_path: Path) -> None:
    reference = train("paci", tmp_path, *DROPOUT, iters=4)
    assert max(max(w.drift_histogram) for w in reference[2]) >= 1  # stage 0 crosses updates
    unstashed = train("paci", tmp_path, *DROPOUT, *FULL_UNIFORM, iters=4)
    assert unstashed[0][0] == reference[0][0]  # the first update's window saw no update yet
    assert max_difference(unstashed[1], reference[1]) > 1e-6  # then the backward weights differ
    assert_same_training(train("paci", tmp_path, *DROPOUT, *FULL_UNIFORM, "--recompute-stash-weights", iters=4),
                         reference)
    assert_same_training(train("paci", tmp_path, *DROPOUT, *SELECTIVE, iters=4), reference)


def test_distributed_runtime_equals_emulator_with_recompute(tmp_path: Path) -> None:
    argv = [*tiny_args(2, "zb-h1", 4, 2, "--num-layers", "4", *DROPOUT, *FULL_BLOCK)]
    records, dist_params = run_pretrain(argv, tmp_path / "dist")
    losses, emu_params, _ = train("zb-h1", tmp_path, *DROPOUT, *FULL_BLOCK, iters=2)
    assert [r["loss"] for r in records] == losses
    assert max_difference(dist_params, emu_params) == 0.0


# ------------------------------------------------------------------ simulator memory model


@pytest.mark.parametrize("m_f", [1.0, 0.5, 0.25])
def test_simulator_memory_model_with_recompute(m_f: float) -> None:
    """F keeps m_f M_B, W's M_W is unchanged: 1F1B peaks at (p - s) m_f; ZB-H1 at the paper's
    (p - i + 1) M_F + (i - 1) M_W on 1-based worker i, plus M_W - M_F while a B holds M_W before
    a W frees it, which only happens once recompute makes M_F < M_W (the peak moves to the last
    stage and exceeds 1F1B's)."""
    from megatron.pipeline.schedules import ScheduleConfig, build_schedule
    from megatron.pipeline.costs.op_costs import OpCosts
    from megatron.pipeline.simulator import simulate_schedule

    p, m_w = 4, 0.5
    config = ScheduleConfig(num_stages=p, num_microbatches=8, num_iterations=1)
    peaks = {name: simulate_schedule(build_schedule(name, config), OpCosts(m_w=m_w, m_f=m_f)).peak_memory
             for name in ("1f1b", "zb-h1")}
    assert peaks["1f1b"] == pytest.approx([(p - s) * m_f for s in range(p)])
    want = [(p - i + 1) * m_f + (i - 1) * m_w + max(0.0, m_w - m_f) for i in range(1, p + 1)]
    assert peaks["zb-h1"] == pytest.approx(want)


def test_activation_model_fractions() -> None:
    from megatron.pipeline.costs.activation_memory import LayerShape, recompute_costs, recompute_fraction
    from megatron.pipeline.costs.op_costs import OpCosts

    shape = LayerShape(seq_length=256, micro_batch_size=2, hidden_size=128, num_attention_heads=4)
    per_layer = 34 + 5 * 4 * 256 / 128  # Korthikanti: sbh (34 + 5as/h)
    assert recompute_fraction(shape, 4, None) == 1.0
    assert recompute_fraction(shape, 4, "selective") == pytest.approx(34 / per_layer)
    assert recompute_fraction(shape, 4, "full", "uniform", 1) == pytest.approx(2 / per_layer)
    assert recompute_fraction(shape, 4, "full", "uniform", 2) == pytest.approx(1 / per_layer)
    assert recompute_fraction(shape, 4, "full", "block", 4) == recompute_fraction(shape, 4, "full", "uniform", 1)
    assert recompute_fraction(shape, 4, "full", "block", 2) == pytest.approx((2 * 2 + 2 * per_layer) / (4 * per_layer))
    costs = recompute_costs(OpCosts(t_f=1.0, t_b=1.0, t_w=1.0), shape, 4, "full", "uniform", 1)
    assert (costs.t_b, costs.t_w, costs.fused_backward) == (2.0, 1.0, 3.0)  # B reruns the forward
