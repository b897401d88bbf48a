"""Evaluation through the pipeline (--eval-interval / --eval-iters), segments and TensorBoard.

References: the validation loss computed directly from the trained chunks (no pipeline, no
executor), the same loss from a one-stage run, and a run with the same segment boundaries
but no evaluation (evaluation must not perturb training).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from async_helpers import emulate, read_log, tiny_args

from megatron.pipeline.ir import PipelineLayout
from megatron.pipeline.schedules.evaluation import evaluation_streams
from megatron.pipeline.schedule_check import check_streams
from megatron.trainer.plan.parse import parse_args, parse_run_plan
from megatron.trainer.tasks.gpt import GPTTask
from megatron.trainer.loop.segments import Segment, plan_segments

EVAL_ITERS = 2


def _run(tmp_path: Path, name: str, stages: int, schedule: str, *extra: str):
    log = tmp_path / f"{name}.jsonl"
    argv = [*tiny_args(stages, schedule, 4, 10, "--num-layers", "4"), "--log-json", str(log), *extra]
    return emulate(argv), read_log(log), parse_run_plan(argv)


def _direct_loss(workers, config, split: str) -> float:
    """Token-weighted loss of ``split``'s first --eval-iters batches, chaining the chunks by hand."""
    task = GPTTask()
    batch_fn = task.batch_fn(config, 0, torch.device("cpu"), split=split)
    loss_sum, tokens = 0.0, 0
    for w in workers:
        for chunk in w.setup.chunks:
            chunk.eval()
    with torch.no_grad():
        for mb in range(EVAL_ITERS * config.num_microbatches):
            batch, x = batch_fn(mb), None
            for w in workers:
                x = w.setup.chunks[0](x, batch)
            loss, n = task.loss_fn(x, batch)
            loss_sum += float(loss) * n
            tokens += n
    return loss_sum / tokens


def _evals(records: list[dict], split: str = "valid") -> dict[int, float]:
    return {r["iteration"]: r["eval_loss"] for r in records if r.get("eval_split") == split}


@pytest.mark.parametrize("schedule", ["1f1b", "paci"])
def test_pipeline_evaluation_equals_direct_evaluation(megatron_world1, tmp_path: Path, schedule: str) -> None:
    workers, records, config = _run(tmp_path, "run", 4, schedule, "--eval-interval", "4",
                                    "--eval-iters", str(EVAL_ITERS))
    valid, test = _evals(records), _evals(records, "test")
    assert sorted(valid) == [4, 8, 10] and sorted(test) == [10]
    assert valid[10] == pytest.approx(_direct_loss(workers, config, "valid"), rel=1e-6)
    assert test[10] == pytest.approx(_direct_loss(workers, config, "test"), rel=1e-6)
    assert valid[10] != test[10]  # different data
    final = [r for r in records if r.get("eval_split") == "valid" and r["iteration"] == 10][0]
    assert final["eval_ppl"] == pytest.approx(math.exp(final["eval_loss"]))


def test_pipelined_evaluation_equals_one_stage(megatron_world1, tmp_path: Path) -> None:
    flags = ("--eval-interval", "5", "--eval-iters", str(EVAL_ITERS), "--hidden-dropout", "0",
             "--attention-dropout", "0")
    _, one, _ = _run(tmp_path, "one", 1, "1f1b", *flags)
    _, four, _ = _run(tmp_path, "four", 4, "1f1b", *flags)
    for it, loss in _evals(one).items():
        assert _evals(four)[it] == pytest.approx(loss, rel=1e-5)


def test_evaluation_does_not_perturb_training(megatron_world1, tmp_path: Path) -> None:
    """Same segment boundaries (a checkpoint also ends a segment), with and without evaluation."""
    _, with_eval, _ = _run(tmp_path, "eval", 4, "paci", "--eval-interval", "3", "--eval-iters", "1")
    _, without, _ = _run(tmp_path, "save", 4, "paci", "--save", str(tmp_path / "ck"), "--save-interval", "3")
    train = [(r["iteration"], r["loss"]) for r in with_eval if "loss" in r]
    assert train == [(r["iteration"], r["loss"]) for r in without if "loss" in r]
    assert len(train) == 10


@pytest.mark.parametrize("stages,chunks", [(n, c) for n in range(2, 9) for c in (1, 2, 3)])
def test_schedule_check_accepts_evaluation_streams(stages: int, chunks: int) -> None:
    layout = PipelineLayout(stages, chunks)
    counts = check_streams(evaluation_streams(layout, 5), layout, forward_only=True)
    assert counts == [5 * chunks] * stages


def test_segment_plan() -> None:
    assert plan_segments(0, 10) == [Segment(0, 10)]
    assert plan_segments(0, 10, eval_interval=4) == [
        Segment(0, 4, evaluate=True), Segment(4, 8, evaluate=True), Segment(8, 10, evaluate=True, test=True)]
    assert plan_segments(0, 10, save_interval=5, saving=True) == [Segment(0, 5, save=True), Segment(5, 10, save=True)]
    assert plan_segments(0, 10, save_interval=5) == [Segment(0, 5), Segment(5, 10)]
    assert plan_segments(3, 10, exit_interval=4, saving=True) == [Segment(3, 4, save=True, exit=True)]
    assert plan_segments(4, 8, eval_interval=4, exit_interval=8, saving=True) == [
        Segment(4, 8, evaluate=True, test=True, save=True)]  # exit at the end is just the end


def test_tensorboard_events_are_written_and_readable(megatron_world1, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, records, _ = _run(tmp_path, "tb", 2, "paci", "--eval-interval", "5", "--eval-iters", "1",
                         "--tensorboard-dir", str(tmp_path / "tb"), "--log-activation-memory")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/lm-loss", "train/learning-rate", "throughput/tokens-per-s", "valid/lm-loss",
            "valid/lm-loss-ppl", "test/lm-loss", "drift/max-stage0", "drift/max-stage1",
            "memory/peak-activation-mb-stage0"} <= tags
    train = [r for r in records if "loss" in r]
    logged = events.Scalars("train/lm-loss")
    assert [e.step for e in logged] == [r["iteration"] for r in train]
    assert [e.value for e in logged] == pytest.approx([r["loss"] for r in train], rel=1e-6)
    assert [e.step for e in events.Scalars("valid/lm-loss")] == [5, 10]
    assert [e.value for e in events.Scalars("drift/max-stage0")] == [r["drift_max"][0] for r in train]


@pytest.mark.parametrize("flags,message", [
    (("--save-interval", "5"), "--save-interval needs --save DIR"),
    (("--eval-interval", "5", "--eval-iters", "0"), "--eval-interval needs --eval-iters >= 1"),
    (("--exit-interval", "0"), "--exit-interval must be >= 1, got 0"),
])
def test_run_control_flag_errors(capsys, flags: tuple[str, ...], message: str) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args([*tiny_args(2, "1f1b", 4, 10), *flags])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"
