"""Tensor parallelism in the distributed runtime (issue 15, item 1): TP = 2 x PP = 2 on 4 gloo ranks
trains like TP = 1 x PP = 2.

The reference is independent of the TP code path: the emulator at TP = 1 (one process, no TP
group; bitwise the runtime at TP = 1, which other tests check). Every TP = 2 run must give its
losses (<= 1e-5 relative per iteration) and, gathered over the TP group, its final parameters.
That exercises the TP-matched P2P pairs, the TP-reduced gradient norm under --clip-grad
(sharded part summed over the group, replicated part once), reports from TP rank 0 only and
the gathered parameter dump. fp32, no dropout, a tiny GPT with biases (so replicated row-parallel
biases and norms are in the norm too).

TP = 2 x DP = 2 x PP = 1 with ``--use-distributed-optimizer`` (ZeRO-1 over each TP index's DP
group) trains like the replicated optimizer at the same layout (<= 1e-6), with clipping active,
and its per-(stage, dp, tp) checkpoint files resume bitwise.

All runs of a test share one launch of 4 forked ranks (``tests/tp_runtime_driver.py``): importing
megatron-core dominates the cost of a launch.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.async_helpers import REPO, assert_trains_like, emulated_reference, read_log

pytestmark = [pytest.mark.usefixtures("megatron_world1"), pytest.mark.numerics]

HEADS, HIDDEN = 4, 32
MODEL = ["--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS), "--seq-length", "16",
         "--vocab-size", "64", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3",
         "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0", "--num-threads", "1",
         "--lr", "1e-3", "--lr-warmup-iters", "1", "--clip-grad", "0.5", "--pipeline-model-parallel-size", "2",
         "--device", "cpu", "--pipeline-timeout-seconds", "120",
         "--untie-embeddings-and-output-weights"]  # the runs compare layouts; tying: tests/test_tied_embeddings.py
# (name, flags): what each schedule needs beyond MODEL.
DONE_WHEN = [
    ("1f1b", ["--num-layers", "2"]),
    ("paci", ["--num-layers", "2"]),
    ("zb-2p", ["--num-layers", "2", "--zb-costs", "1,1,1,0"]),
    ("interleaved-1f1b", ["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"]),
]
OTHERS = [
    ("gpipe", ["--num-layers", "2"]),
    ("async-1f1b", ["--num-layers", "2", "--global-batch-size", "1"]),
    ("zb-h1", ["--num-layers", "2"]),
    ("zb-h2", ["--num-layers", "2"]),
    ("zb-1p", ["--num-layers", "2", "--zb-profile-iters", "1"]),  # profiling: ping-pong over TP pairs
    ("pipedream-2bw", ["--num-layers", "2"]),
    ("pipemare", ["--num-layers", "2"]),
    ("amdp", ["--num-layers", "2"]),
    ("1f1b", ["--num-layers", "2", "--enable-optimizer-post-validation"]),
    ("1f1b", ["--num-layers", "2", "--log-params-norm", "--eval-interval", "3", "--eval-iters", "1"]),
]


def _argv(schedule: str, flags: list[str]) -> list[str]:
    return [*MODEL, "--pipeline-schedule", schedule, *flags]


def _launch_tp2(runs: list[tuple[str, list[str]]], tmp_path: Path, ranks: int = 4) -> list[tuple[list[dict], dict]]:
    """Every run at TP = 2 in one launch of ``ranks`` ranks; per run its log records and gathered parameters."""
    dirs = [tmp_path / f"run{i}" for i in range(len(runs))]
    argvs = [[*_argv(s, f), "--tensor-model-parallel-size", "2", "--log-json", str(d / "log.jsonl"),
              "--dump-final-params", str(d / "params")] for (s, f), d in zip(runs, dirs)]
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(argvs))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "tp_runtime_driver.py"), str(spec), str(ranks)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    out = []
    for d in dirs:
        params: dict[str, torch.Tensor] = {}
        for f in sorted((d / "params").glob("stage*.pt")):
            params.update(torch.load(f))
        out.append((read_log(d / "log.jsonl"), params))
    return out


def _assert_same_training(tp2: tuple[list[dict], dict], schedule: str, flags: list[str], tmp_path: Path) -> None:
    """TP = 2 against the TP = 1 emulator, within the tolerances tests/adam_bounds.py derives."""
    ref = emulated_reference(_argv(schedule, flags), tmp_path / f"tp1-{schedule}.jsonl")
    assert_trains_like(*tp2, ref, context=f"{schedule} {flags}: ")


def test_tp2_pp2_trains_like_tp1_for_1f1b_paci_zb2p_interleaved(tmp_path):
    for (schedule, flags), result in zip(DONE_WHEN, _launch_tp2(DONE_WHEN, tmp_path)):
        _assert_same_training(result, schedule, flags, tmp_path)


def test_every_other_schedule_trains_like_tp1_at_tp2(tmp_path):
    for (schedule, flags), result in zip(OTHERS, _launch_tp2(OTHERS, tmp_path)):
        assert all(math.isfinite(r["loss"]) for r in result[0] if "loss" in r), schedule
        _assert_same_training(result, schedule, flags, tmp_path)


def test_amdp_replicas_at_tp2_train_like_tp1(tmp_path):
    """AMDP on 4 devices: 2 replicated pipelines whose replicas sum gradients and shard AdamW
    state per TP index (8 ranks: PP 4 x TP 2)."""
    runs = [("amdp", ["--num-layers", "4", "--pipeline-model-parallel-size", "4"])]
    (result,) = _launch_tp2(runs, tmp_path, ranks=8)
    _assert_same_training(result, *runs[0], tmp_path)


# V placement at TP = 2 (issue 31): 2 stages x 2 V chunks of one layer each.
V_RUNS = [("zb-v", ["--num-layers", "4", "--zb-costs", "1,1,1,0"]), ("dualpipev", ["--num-layers", "4"])]


def test_v_schedules_at_tp2_train_like_tp1_and_like_1f1b(tmp_path):
    """zb-v and dualpipev at TP = 2 through the distributed runtime: like their own TP = 1
    emulator run (the TP-matched pairs of a V include the local turn on stage 1 and stage 0's
    embedding + head), and like 1F1B's TP = 1 run (another order of the same sums: the
    tolerances tests/adam_bounds.py derives for any reduction order)."""
    one_f_one_b = emulated_reference(_argv("1f1b", ["--num-layers", "4"]), tmp_path / "tp1-1f1b.jsonl")
    for (schedule, flags), result in zip(V_RUNS, _launch_tp2(V_RUNS, tmp_path)):
        _assert_same_training(result, schedule, flags, tmp_path)
        assert_trains_like(*result, one_f_one_b, context=f"{schedule} vs 1f1b: ")


# TP 2 x DP 2 x PP 1: the distributed optimizer against the replicated one, each pair in one launch.
DP2 = ["--num-layers", "2", "--pipeline-model-parallel-size", "1", "--data-parallel-size", "2",
       "--log-params-norm"]
DISTOPT = [(schedule, [*DP2, *extra]) for schedule in ("1f1b", "paci")
           for extra in ([], ["--use-distributed-optimizer"])]


def test_distributed_optimizer_at_tp2_dp2_equals_the_replicated_optimizer(tmp_path):
    """Each TP rank's flat space holds its TP shards and each DP replica reduces and steps only
    its range of that: the clipping norm must count the TP-sharded elements of every range over
    TP and DP and the replicated ones once. --clip-grad 0.5 is active on every update (the norms
    are above it), so a wrong norm would change every step."""
    results = _launch_tp2(DISTOPT, tmp_path)
    for i in range(0, len(DISTOPT), 2):
        (plain_records, plain_params), (records, params) = results[i], results[i + 1]
        assert [r.get("iteration") for r in records] == [r.get("iteration") for r in plain_records] == [1, 2, 3]
        assert all(r["grad_norm"] > 0.5 for r in plain_records), plain_records
        for ours, ref in zip(records, plain_records):
            for key in ("loss", "grad_norm", "params_norm"):
                assert ours[key] == pytest.approx(ref[key], rel=1e-6, abs=0), (DISTOPT[i][0], key, ours, ref)
        assert params.keys() == plain_params.keys()
        for name, ref in plain_params.items():
            torch.testing.assert_close(params[name], ref, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_distributed_optimizer_checkpoint_at_tp2_dp2_resumes_bitwise_and_reshards(tmp_path):
    """Files per (stage, dp, tp), each holding the stage's whole optimizer state of its TP shard
    (gathered over DP at save): a same-layout resume continues bitwise, and the checkpoint passes
    the up-front checks for another TP size and for whole (unsharded) optimizer states."""
    from megatron.trainer.checkpointing.checkpoint import check_resume
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.tasks.gpt import GPTTask

    save = tmp_path / "ckpt"
    flags = [*DP2, "--use-distributed-optimizer", "--train-iters", "4"]
    runs = [("1f1b", flags), ("1f1b", [*flags, "--save", str(save), "--exit-interval", "2"]),
            ("1f1b", [*flags, "--load", str(save)])]
    (full, _, resumed) = _launch_tp2(runs, tmp_path)
    assert [r["iteration"] for r in resumed[0]] == [3, 4]
    assert [(r["loss"], r["grad_norm"]) for r in resumed[0]] == [(r["loss"], r["grad_norm"]) for r in full[0][2:]]
    assert resumed[1].keys() == full[1].keys()
    assert all(torch.equal(resumed[1][name], value) for name, value in full[1].items())
    index = json.loads((save / "iter_0000002" / "metadata.json").read_text())["index"]
    assert len(index) == 4 and not any(entry["optimizer_sharded"] for entry in index.values())
    base = [*_argv("1f1b", flags), "--load", str(save)]
    check_resume(GPTTask(), parse_run_plan([*base, "--tensor-model-parallel-size", "1"]))
    check_resume(GPTTask(), parse_run_plan([a for a in base if a != "--use-distributed-optimizer"] + TP2))


TP2 = ["--tensor-model-parallel-size", "2"]
REFUSED = [
    ([*TP2, "--pipeline-executor", "emulator"], "the emulator (one process) does not have: use --pipeline-executor distributed"),
    ([*TP2, "--hidden-size", "48", "--num-attention-heads", "3"], "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"),
    ([*TP2, "--group-query-attention", "--num-query-groups", "1"], "--num-query-groups 1 is not divisible by --tensor-model-parallel-size 2"),
    ([*TP2, "--ffn-hidden-size", "33"], "--ffn-hidden-size 33 is not divisible by --tensor-model-parallel-size 2"),
    ([*TP2, "--vocab-size", "63"], "--vocab-size (padded) 63 is not divisible by --tensor-model-parallel-size 2"),
    ([*TP2, "--optimizer", "basis-rotation"], "the rotation bases of a weight's shard are not those of the full weight"),
    ([*TP2, "--pipeline-partition", "auto"], "a tensor-parallel layer needs its whole TP group"),
    (["--distribute-saved-activations"], "keeps each region's input whole on every tensor-parallel rank"),
    (["--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    ([*TP2, "--sequence-parallel", "--seq-length", "15"], "--seq-length 15 is not divisible by --tensor-model-parallel-size 2"),
]


@pytest.mark.parametrize("argv,says", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_tensor_parallel_bad_inputs_refused_with_one_line(argv, says, capsys, tmp_path, monkeypatch):
    from tests.async_helpers import assert_flag_error

    monkeypatch.chdir(tmp_path)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert_flag_error(capsys, argv, says)


def test_attention_dropout_at_tp2_repeats_under_recompute(tmp_path):
    """Attention dropout at TP = 2 draws per-TP-rank masks from the stage stream
    (``sdpa_attention.tensor_parallel_dropout_stream``): full recompute redraws them exactly,
    so it trains bitwise like no recompute."""
    dropout = ["--num-layers", "2", "--attention-dropout", "0.3", "--hidden-dropout", "0.1"]
    runs = [("1f1b", dropout), ("1f1b", [*dropout, "--recompute-granularity", "full",
                                         "--recompute-method", "uniform", "--recompute-num-layers", "1"])]
    (plain, _), (recomputed, _) = _launch_tp2(runs, tmp_path)
    assert [r["loss"] for r in recomputed] == [r["loss"] for r in plain]
    assert [r["grad_norm"] for r in recomputed] == [r["grad_norm"] for r in plain]


def test_transformer_engine_at_tp2_refused_and_auto_picks_the_local_spec():
    """TE's TP layers carry no shard marks our init and checkpoints read: an explicit TE request
    at TP > 1 is refused (checked directly: on a CPU machine the "TE needs a GPU" refusal comes
    first), and ``auto`` resolves to the local spec at TP > 1 even where TE would run."""
    import argparse

    from megatron.trainer.plan.parse import parse_args, parse_run_plan
    from megatron.trainer.config.errors import ConfigError
    from megatron.trainer.plan.build import build_run_plan
    from megatron.trainer.config.tensor_parallel_args import check_tensor_parallel_flags
    from megatron.trainer.tasks.stage_tasks import transformer_kwargs

    args = parse_args([*_argv("1f1b", ["--num-layers", "2"]), *TP2])
    check_tensor_parallel_flags(args)
    assert transformer_kwargs(build_run_plan(args))["use_transformer_engine"] is False
    assert transformer_kwargs(parse_run_plan(_argv("1f1b", ["--num-layers", "2"])))["use_transformer_engine"] is None
    te = argparse.Namespace(**{**vars(args), "transformer_impl": "transformer_engine"})
    with pytest.raises(ConfigError, match="TE's tensor-parallel layers are not mapped"):
        check_tensor_parallel_flags(te)
