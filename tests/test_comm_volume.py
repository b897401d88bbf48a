"""Communication volume per step: the schedule-derived theory against the closed form and
against the bytes the distributed runtime really hands to gloo.

* pure (no torch): :func:`step_comm_volume` counts, per rank and step, the closed form's
  ``m * s*b*h * dtype`` per direction per hop for every schedule family (interleaving doubles
  the hops, AMDP splits the micro-batches over its pipelines), one data-parallel reduction of
  the stage's gradients per update, the norm messages of post-validation;
* runtime: ``benchmarks/comm_volume.py`` runs tiny GPTs over gloo with its counting shim (1F1B
  at PP=2 x DP=2: activations, gradients, data-parallel all-reduce, norm gather; AMDP on 4
  devices: replica gradient and parameter all-gathers) and every counted category must equal
  the theory exactly.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.pipeline.comm_volume import (CommShapes, analytic_p2p_bytes, ring_all_gather_bytes,
                                           ring_all_reduce_bytes, step_comm_volume)
from megatron.pipeline.schedules.zero_bubble.post_validation_flags import PostValidationOptions
from megatron.pipeline.schedules import ScheduleConfig, build_schedule

REPO = Path(__file__).resolve().parent.parent
MESSAGE = 4 * 8 * 2 * 16  # fp32 [s=8, b=2, h=16]


def _shapes(schedule, dp: int = 1) -> CommShapes:
    layout = schedule.layout
    params = {(s, c): 1000 + 10 * layout.model_stage(s, c) for s in range(layout.num_stages)
              for c in range(layout.num_chunks)}
    return CommShapes(8 * 2 * 16, 4, params, data_parallel_size=dp)


@pytest.mark.parametrize("name,stages,chunks,micro", [
    ("1f1b", 4, 1, 8), ("gpipe", 3, 1, 5), ("zb-h1", 4, 1, 8), ("zb-2p", 4, 1, 8), ("paci", 4, 1, 4),
    ("interleaved-1f1b", 4, 2, 8), ("amdp", 4, 1, 8), ("amdp", 8, 1, 8), ("async-1f1b", 3, 1, 1),
])
def test_p2p_volume_is_the_closed_form(name: str, stages: int, chunks: int, micro: int) -> None:
    config = ScheduleConfig(num_stages=stages, num_microbatches=micro, num_iterations=3, num_chunks=chunks)
    schedule = build_schedule(name, config)
    volume = step_comm_volume(schedule, _shapes(schedule))
    for stage, v in enumerate(volume):
        act, grad = analytic_p2p_bytes(schedule.layout, stage, micro, MESSAGE)
        assert (v.get("p2p_act", 0), v.get("p2p_grad", 0)) == pytest.approx((act, grad)), (stage, v)
    assert sum(v.get("p2p_act", 0) for v in volume) > 0


def test_data_parallel_volume_is_one_reduction_of_the_stage_per_update() -> None:
    for name in ("1f1b", "paci", "interleaved-1f1b"):
        chunks = 2 if name == "interleaved-1f1b" else 1
        schedule = build_schedule(name, ScheduleConfig(num_stages=2, num_microbatches=4, num_iterations=2,
                                                       num_chunks=chunks, data_parallel_size=2))
        shapes = _shapes(schedule, dp=2)
        for stage, v in enumerate(step_comm_volume(schedule, shapes)):
            assert v["updates"] == 1
            assert v["data_parallel"] == shapes.stage_params(stage) * 4
    assert ring_all_reduce_bytes(100.0, 4) == 150.0 and ring_all_reduce_bytes(100.0, 1) == 0.0
    assert ring_all_gather_bytes(100.0, 4) == 300.0


def test_post_validation_sends_norms_and_reruns_resend_activations() -> None:
    config = ScheduleConfig(num_stages=3, num_microbatches=4, num_iterations=2, options=PostValidationOptions(post_validation=True))
    schedule = build_schedule("1f1b", config)
    kept = step_comm_volume(schedule, _shapes(schedule))
    rerun = step_comm_volume(schedule, _shapes(schedule), reruns=True)
    assert [v.get("p2p_partial_state", 0) for v in kept] == [24, 24, 0]  # 3 float64 norms, s -> s + 1
    assert [v.get("p2p_global_state", 0) for v in kept] == [0, 24, 24]
    assert kept[0]["p2p_act"] == 4 * MESSAGE and rerun[0]["p2p_act"] > kept[0]["p2p_act"]
    assert all("sync_norms" in v and v["sync_norms"] == 0 for v in kept)  # no synchronous OPT left


@pytest.mark.slow
def test_runtime_traffic_equals_the_theory(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "comm_volume.py"), "--cases", "1f1b@2x2", "amdp@4x1",
           "--layers", "4", "--hidden", "16", "--heads", "2", "--seq", "8", "--vocab", "64",
           "--microbatches", "4", "--no-scaled", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [r for r in json.loads(out.read_text()) if r["theory"] is not None]
    seen = {(r["case"], r["kind"]) for r in rows}
    for kind in ("p2p_act", "p2p_grad", "data_parallel", "sync_norms"):
        assert ("1f1b", kind) in seen, kind
    for kind in ("p2p_act", "p2p_grad", "replica_grads", "replica_params", "sync_norms"):
        assert ("amdp", kind) in seen, kind
    for r in rows:
        assert r["measured"] == r["theory"] and r["spread"] == 0, r
        if r["closed_form"] is not None:
            assert r["measured"] == r["closed_form"], r


def test_distributed_optimizer_memory_hook_follows_the_trainer() -> None:
    """``benchmarks/per_rank_memory.py --distributed-optimizer DP`` is refused with one line
    naming the trainer's refusal while ``--use-distributed-optimizer`` is refused, and opens by
    itself once the trainer accepts the flag."""
    from benchmarks.comm_volume import Model
    from benchmarks.per_rank_memory import check_distributed_optimizer
    from megatron.trainer.config.megatron_compat_args import REFUSED_FLAGS

    model = Model(layers=2, hidden=16, heads=2, seq=8, vocab=64, microbatches=2)
    with pytest.raises(SystemExit, match="DP >= 2"):
        check_distributed_optimizer(model, 1)
    if "use_distributed_optimizer" in REFUSED_FLAGS:
        with pytest.raises(SystemExit) as refused:
            check_distributed_optimizer(model, 2)
        assert "--use-distributed-optimizer" in str(refused.value.code) and "\n" not in str(refused.value.code)
    else:
        check_distributed_optimizer(model, 2)
