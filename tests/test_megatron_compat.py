"""Megatron-LM compatibility flags: every parser flag is used or refused, refusals are one
line, sample counts and warm-up fractions convert as Megatron-LM counts, a batch-size rampup
follows megatron-core's calculator under every schedule, WSD is reachable, and
``--no-load-optim`` / ``--finetune`` load what they say.
"""
from __future__ import annotations

import argparse
import ast
import json
import types
from pathlib import Path

import pytest
import torch

from megatron.trainer.config.arguments import build_parser
from megatron.trainer.plan.parse import parse_args, parse_run_plan
from megatron.trainer.plan.build import build_run_plan
from megatron.trainer.tasks.bert import BertTask
from megatron.trainer.config.megatron_compat_args import DEFAULT_BEHAVIOUR_FLAGS, REFUSED_FLAGS
from megatron.trainer.tasks.synthetic import SyntheticCostTask
from tests.async_helpers import REPO, assert_runtime_equals_emulator, emulate, tiny_args

SOURCES = [*sorted((REPO / "megatron").rglob("*.py")), *sorted(REPO.glob("pretrain_*.py"))]


# ------------------------------------------------------------------------ flag audit


def referenced_names(paths: list[Path]) -> set[str]:
    """Attribute names read or written anywhere (``args.foo``), plus ``getattr(x, "foo")``-style
    string names and string subscripts (``values["foo"]``: a schedule's flag values, read by its
    ``FlagGroup.to_options``): a flag whose dest appears in none is never looked at."""
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                  and isinstance(node.slice.value, str)):
                names.add(node.slice.value)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                names.add(node.args[1].value)
    return names


def unused_flags(parser: argparse.ArgumentParser, names: set[str]) -> list[str]:
    """Option strings of ``parser`` neither referenced nor in an explicit table."""
    explained = set(REFUSED_FLAGS) | set(DEFAULT_BEHAVIOUR_FLAGS) | {"help"}
    return [a.option_strings[0] for a in parser._actions
            if a.dest not in names and a.dest not in explained]


def _parser(task=None) -> argparse.ArgumentParser:
    parser = build_parser()
    if task is not None:
        task.add_arguments(parser)
    return parser


@pytest.fixture(scope="module")
def names() -> set[str]:
    return referenced_names(SOURCES)


@pytest.mark.parametrize("task", [None, BertTask(), SyntheticCostTask()], ids=["gpt", "bert", "synthetic"])
def test_every_parser_flag_is_used_or_refused(task, names):
    assert unused_flags(_parser(task), names) == []


def test_flag_audit_catches_an_unused_flag(names):
    parser = _parser()
    parser.add_argument("--accepted-and-ignored-flag", type=int, default=0)
    assert unused_flags(parser, names) == ["--accepted-and-ignored-flag"]


def test_explicit_tables_name_real_flags():
    dests = {a.dest for a in _parser()._actions}
    assert set(REFUSED_FLAGS) <= dests and set(DEFAULT_BEHAVIOUR_FLAGS) <= dests


# ------------------------------------------------------------------------ refusals

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--vocab-size", "64"]
REFUSALS = [
    *[([f"--{dest.replace('_', '-')}"], message) for dest, message in REFUSED_FLAGS.items()],
    (["--optimizer", "sgd"], "--optimizer sgd is not implemented"),
    (["--transformer-impl", "transformer_engine", "--device", "cpu"], "needs a GPU"),
    (["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine needs"),
    (["--attention-backend", "flash"], "--attention-backend flash needs --transformer-impl transformer_engine"),
    (["--reset-position-ids"], "--reset-position-ids need --data-path"),
    (["--reset-attention-mask", "--eod-mask-loss"], "--reset-attention-mask --eod-mask-loss need --data-path"),
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "50"], "--lr-wsd-decay-iters 50 must be in [1, 20]"),
    (["--train-iters", "3", "--train-samples", "5"], "mutually exclusive"),
    (["--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"], "only specify one of"),
    (["--lr-decay-iters", "5", "--lr-decay-samples", "8"], "--lr-decay-samples and --lr-decay-iters"),
    (["--no-load-optim"], "need --load"),
    (["--rotary-base", "500"], "need --position-embedding-type rope"),
    (["--global-batch-size", "6", "--rampup-batch-size", "2", "3", "8"], "multiple of INCREMENT 3"),
    (["--global-batch-size", "8", "--micro-batch-size", "2", "--rampup-batch-size", "1", "1", "8"],
     "global batch 1 of the ramp is not divisible by --micro-batch-size 2"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "async-1f1b", "--global-batch-size", "4",
      "--rampup-batch-size", "2", "2", "4"], "global batch 4 of the ramp: async-1f1b updates after every"),
    *[(["--pipeline-model-parallel-size", "2", "--pipeline-schedule", name, "--global-batch-size", "8",
        "--rampup-batch-size", "4", "2", "8"], f"--rampup-batch-size: {name} ") for name in
      ("pipedream-2bw", "pipemare", "zb-1p", "zb-2p")],
    (["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "interleaved-1f1b",
      "--num-layers-per-virtual-pipeline-stage", "1", "--num-layers", "4", "--global-batch-size", "4",
      "--rampup-batch-size", "2", "2", "4"], "global batch 2 of the ramp"),
]


@pytest.mark.parametrize("flags,message", REFUSALS, ids=[" ".join(f) for f, _ in REFUSALS])
def test_refusal_is_one_line_before_any_rank(flags, message, capsys):
    if "--transformer-impl" in flags and "cpu" not in flags:
        pytest.importorskip("megatron.core")  # the check is the package's absence or no GPU: both here
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*BASE, *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert message in err and err.count("\n") == 1, err


def test_wandb_refused_without_the_package(capsys, monkeypatch):
    """Whether or not this machine has wandb: the check asks find_spec, so hide the package."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "wandb" else real_find_spec(name, *a, **k))
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--wandb-project", "p", "--wandb-exp-name", "e"])
    assert "--wandb-project needs the wandb package" in capsys.readouterr().err


def test_bert_refuses_what_its_model_lacks(capsys):
    for flags in (["--position-embedding-type", "none"], ["--eod-mask-loss"]):
        with pytest.raises(SystemExit):
            parse_args([*BASE, *flags], _parser(BertTask()))
    assert capsys.readouterr().err.count("\n") == 2


# ------------------------------------------------------------------------ sample counts


def test_megatron_optimizer_name_adam_is_adamw():
    assert parse_args([*BASE, "--optimizer", "adam"]).optimizer == "adamw"


def test_sample_counts_convert_like_megatron():
    args = parse_args([*BASE, "--global-batch-size", "4", "--micro-batch-size", "2", "--train-samples", "10",
                       "--lr-decay-samples", "9", "--lr-warmup-samples", "8"])
    # Megatron-LM: train_iters = train_samples // global batch; warm-up/decay in whole iterations.
    assert (args.train_iters, args.lr_decay_iters, args.lr_warmup_iters) == (2, 3, 2)
    args = parse_args([*BASE, "--train-iters", "10", "--lr-decay-iters", "8", "--lr-warmup-fraction", "0.25"])
    assert args.lr_warmup_iters == 2  # fraction of the decay length, as Megatron-LM
    # With a rampup 2 -> 6 by 2 over 8 samples the batches are 2, 2, 4, 6, 6, ... (consumed 2, 4,
    # 8, 14, 20): Megatron-LM's update_train_iters counts the ramp, then whole final batches.
    args = parse_args([*BASE, "--global-batch-size", "6", "--micro-batch-size", "1", "--rampup-batch-size",
                       "2", "2", "8", "--train-samples", "27"])
    assert args.train_iters == 4 + (27 - 14) // 6


# ------------------------------------------------------------------------ rampup


def calculator_batches(start: int, increment: int, samples: int, final: int, iterations: int) -> list[int]:
    """Global batch of each iteration, as Megatron-LM's training loop asks megatron-core."""
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    calc = RampupBatchsizeNumMicroBatchesCalculator(final, 1, 1, False, 0, start, increment, samples)
    out, consumed = [], 0
    for _ in range(iterations):
        calc.update(consumed, consistency_check=True)
        out.append(calc.get_current_global_batch_size())
        consumed += out[-1]
    return out


# The schedules that ramp (the others are refused, see REFUSALS); zb-1p/zb-2p from fixed costs.
FIXED_COSTS = ("--zb-costs", "1,2,1,0", "--zb-profile-iters", "0")
SCHEDULES = {"1f1b": (), "gpipe": (), "paci": (), "zb-h1": (), "zb-h2": (), "amdp": (), "zb-2p": FIXED_COSTS}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_rampup_segments_read_each_sample_once_per_calculator(schedule):
    """Per segment, the schedule built for its accumulation reads exactly the calculator's
    batch per iteration, consecutive data micro-batches, and steps once per iteration."""
    from megatron.pipeline.ir import OpKind
    from megatron.pipeline.schedules import build_schedule
    from megatron.trainer.config.run_config import schedule_config
    from megatron.trainer.loop.segments import plan_segments
    from megatron.trainer.loop.rampup import segment_boundaries, segment_schedules

    pp, ramp = (4, (4, 4, 12)) if schedule == "amdp" else (2, (4, 2, 12))  # AMDP: multiples of its depth
    args = parse_args([*BASE, "--num-layers", str(pp), "--pipeline-model-parallel-size", str(pp),
                       "--pipeline-schedule", schedule, "--micro-batch-size", "1", "--global-batch-size", "8",
                       "--rampup-batch-size", *map(str, ramp), "--train-iters", "6", *SCHEDULES[schedule]])
    expected = calculator_batches(*ramp, 8, 6)
    assert len(set(expected)) > 1
    config = build_run_plan(args)
    assert [config.batch.global_batch(i) for i in range(6)] == expected
    workers = [types.SimpleNamespace(setup=types.SimpleNamespace(batch_fn=lambda mb: mb, microbatches_per_update=0))]
    base = build_schedule(schedule, schedule_config(args))
    schedule_for = segment_schedules(config, base, workers)
    read, consumed = [], 0
    for seg in plan_segments(0, 6, boundaries=segment_boundaries(config)):
        current = schedule_for(seg.first, seg.end - seg.first)
        assert workers[0].setup.microbatches_per_update == expected[seg.first]
        ops = [op for s in range(pp) for op in current.stage_ops(s)]
        forwards = sorted(workers[0].setup.batch_fn(op.microbatch) for op in ops
                          if op.kind is OpKind.F and current.layout.model_stage(op.stage, op.chunk) == 0)
        size = sum(expected[seg.first:seg.end])
        assert forwards == list(range(consumed, consumed + size)), seg
        consumed += size
        steps = {op.update for op in ops if op.kind is OpKind.OPT and op.stage == 0}
        assert steps == set(range(seg.first, seg.end)), seg
        read.append(size)
    assert sum(read) == sum(expected)


def test_rampup_trains_and_logs_the_calculator_batches(tmp_path):
    log = tmp_path / "log.jsonl"
    argv = [*tiny_args(2, "paci", 6, 5), "--rampup-batch-size", "2", "2", "8", "--pipeline-executor",
            "emulator", "--log-json", str(log)]
    workers = emulate(argv)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["global_batch_size"] for r in records] == calculator_batches(2, 2, 8, 6, 5)
    assert all(w.setup.optimizer.step_count == 5 for w in workers)
    # The first iteration equals a constant-batch run of the ramp's first batch.
    log2 = tmp_path / "constant.jsonl"
    emulate([*tiny_args(2, "paci", 2, 1), "--pipeline-executor", "emulator", "--log-json", str(log2)])
    assert json.loads(log2.read_text().splitlines()[0])["loss"] == records[0]["loss"]


@pytest.mark.usefixtures("megatron_world1")
def test_rampup_runtime_equals_emulator(tmp_path):
    """Two gloo ranks ramp the same way as the emulator, bit for bit."""
    records, _ = assert_runtime_equals_emulator(
        [*tiny_args(2, "paci", 6, 4), "--rampup-batch-size", "2", "2", "8", "--device", "cpu"], tmp_path)
    assert [r["global_batch_size"] for r in records] == calculator_batches(2, 2, 8, 6, 4)


def test_rampup_resume_equals_straight_run(tmp_path):
    """A checkpoint mid-ramp resumes at the right data and accumulation: bitwise the same."""
    from tests.async_helpers import final_params

    argv = [*tiny_args(2, "1f1b", 6, 5), "--rampup-batch-size", "2", "2", "8", "--pipeline-executor", "emulator",
            "--hidden-dropout", "0", "--attention-dropout", "0"]
    straight = final_params(emulate(argv))
    ckpt = str(tmp_path / "ckpt")
    emulate([*argv, "--save", ckpt, "--exit-interval", "3"])  # stops after iteration 3 (batches 2, 2, 4)
    resumed = final_params(emulate([*argv, "--load", ckpt]))
    assert all(torch.equal(straight[n], resumed[n]) for n in straight)


# ------------------------------------------------------------------------ WSD


def test_wsd_is_reachable_and_follows_lr_schedule(tmp_path):
    from megatron.trainer.optim.lr_schedule import LRSchedule

    log = tmp_path / "log.jsonl"
    emulate([*tiny_args(1, "1f1b", 1, 6), "--pipeline-executor", "emulator", "--lr-decay-style", "WSD",
             "--lr-wsd-decay-iters", "3", "--lr-wsd-decay-style", "linear", "--min-lr", "1e-3", "--log-json",
             str(log)])
    lrs = [json.loads(line)["lr"] for line in log.read_text().splitlines()]
    # warm-up 1 (TINY_GPT), stable at the peak, then a linear anneal over the last 3 to min-lr.
    assert lrs[:3] == pytest.approx([1e-2] * 3) and lrs[3:] == pytest.approx([7e-3, 4e-3, 1e-3])
    schedule = LRSchedule(1e-2, 1e-3, 1, 6, "WSD", 3, "linear")
    assert lrs == [schedule.lr(k) for k in range(1, 7)]


# ------------------------------------------------------------------------ loading


def _run(tmp_path: Path, name: str, iters: int, *extra: str) -> tuple[list, list[dict]]:
    log = tmp_path / f"{name}.jsonl"
    workers = emulate([*tiny_args(2, "1f1b", 2, iters), "--pipeline-executor", "emulator", "--log-json", str(log),
                       "--hidden-dropout", "0", "--attention-dropout", "0", *extra])
    return workers, [json.loads(line) for line in log.read_text().splitlines()]


def test_no_load_optim_and_finetune(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _run(tmp_path, "save", 3, "--save", ckpt)
    # --no-load-optim: iteration continues at 3, the optimizer (and its LR schedule) starts fresh.
    workers, records = _run(tmp_path, "nlo", 5, "--load", ckpt, "--no-load-optim", "--lr-warmup-iters", "2")
    assert [r["iteration"] for r in records] == [4, 5]
    assert all(w.setup.optimizer.step_count == 2 for w in workers)
    assert records[0]["lr"] == pytest.approx(0.5e-2)  # warm-up step 1 of 2 again
    # A plain resume continues the LR schedule instead (step 4 is past warm-up).
    _, plain = _run(tmp_path, "resume", 5, "--load", ckpt, "--lr-warmup-iters", "2")
    assert plain[0]["lr"] != records[0]["lr"]
    # --finetune: weights only, from iteration 0; its first loss is the trained weights' loss
    # on the first batch: lower than the fresh model's on the same batch.
    workers, tuned = _run(tmp_path, "ft", 2, "--load", ckpt, "--finetune")
    assert [r["iteration"] for r in tuned] == [1, 2]
    assert all(w.setup.optimizer.step_count == 2 for w in workers)
    _, fresh = _run(tmp_path, "fresh", 1)
    assert tuned[0]["loss"] < fresh[0]["loss"]
    # A model option the checkpoint was not saved with is refused (one line, exit 2).
    with pytest.raises(SystemExit):
        _run(tmp_path, "eps", 5, "--load", ckpt, "--norm-epsilon", "1e-6")


# ------------------------------------------------------------------------ logging


def test_params_norm_and_throughput_are_logged(tmp_path):
    import math

    from megatron.trainer.tasks.gpt import GPTTask
    from megatron.trainer.config.megatron_compat_args import flops_per_iteration

    log = tmp_path / "log.jsonl"
    argv = [*tiny_args(2, "1f1b", 2, 2), "--pipeline-executor", "emulator", "--log-params-norm",
            "--log-throughput", "--log-json", str(log)]
    workers = emulate(argv)
    last = [json.loads(line) for line in log.read_text().splitlines()][-1]
    # by global name: a tied embedding's copy on the last stage is the same weight, counted once
    final = {n: p for w in workers for n, p in GPTTask().named_parameters(w.setup.chunks)}.values()
    assert last["params_norm"] == pytest.approx(math.sqrt(sum(float(p.double().pow(2).sum()) for p in final)))
    assert last["tflops_per_gpu"] > 0
    # 6 x matrix parameters x tokens is the usual estimate; ours also counts attention scores
    # and leaves out the input embedding (a lookup, no multiply).
    config = parse_run_plan(argv)
    matrices = {n: p for w in workers for n, p in GPTTask().named_parameters(w.setup.chunks)
                if p.dim() == 2 and "embedding" not in n}
    matrices["output_layer"] = matrices.get("embedding.word_embeddings.weight", workers[0].setup.chunks[0].model
                                            .embedding.word_embeddings.weight)  # tied: the output multiplies it
    assert flops_per_iteration(config, 1) == pytest.approx(6 * sum(p.numel() for p in matrices.values())
                                                           * config.model.seq_length, rel=0.3)


def test_wandb_receives_every_logged_record():
    from megatron.pipeline.runtime.report import StageReport
    from megatron.trainer.loop.logger import TrainingLogger

    class FakeRun:
        def __init__(self):
            self.logged, self.finished = [], False

        def log(self, values, step):
            self.logged.append((step, values))

        def finish(self):
            self.finished = True

    run = FakeRun()
    logger = TrainingLogger(num_stages=1, train_iters=2, samples_per_iteration=2, tokens_per_iteration=16, wandb=run)
    report = StageReport(stage=0, update=0, updates=1, skipped=0, loss_sum=2.0, loss_count=1, tokens=8, lr=0.1,
                         grad_norm=1.0, drift_max=0, drift_sum=0, drift_count=0, act_peak_count=1,
                         act_peak_bytes=1, mem_peak_bytes=0)
    logger.log_update(0, [report])
    logger.close()
    assert run.finished and run.logged[0][0] == 1 and run.logged[0][1]["loss"] == 2.0
