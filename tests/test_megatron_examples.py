"""Megatron-LM's own example launch flags run here unchanged, with sizes shrunk.

The flag sets are those of NVIDIA/Megatron-LM ``examples/gpt3/train_gpt3_175b_distributed.sh``,
``examples/gpt3/train_gpt3_857m_distributed.sh`` and ``examples/bert/train_bert_340m_distributed.sh``,
flag for flag and in order (``--fp16`` with dynamic loss scaling included); :data:`SHRINK`
replaces only sizes and lengths. Two changes, each named: ``--mock-data`` stands in for
``--data-path``/``--vocab-file``/``--merge-file`` (no corpus in CI) and
``--tensor-model-parallel-size 1`` (the in-process emulator, which these runs use on CPU, has no
tensor-parallel ranks). GPT-3 175B's set also runs as Megatron-LM shards it, tensor-parallel:
``--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2`` on 4 CPU ranks of the
distributed runtime (checkpoints per TP rank included), and trains like the same set at TP = 1
(fp16 loss scaling included: every TP rank takes the same skip decisions).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron.trainer.tasks.bert import BertTask
from megatron.trainer.tasks.gpt import GPTTask
from tests.async_helpers import emulate, run_pretrain

pytestmark = pytest.mark.usefixtures("megatron_world1")

CKPT, TB = "$CHECKPOINT_PATH", "$TENSORBOARD_LOGS_PATH"

# The scripts' arrays: GPT_MODEL_ARGS / BERT_MODEL_ARGS, TRAINING_ARGS, MODEL_PARALLEL_ARGS,
# DATA_ARGS, EVAL_AND_LOGGING_ARGS (the last identical in all three).
EVAL_AND_LOGGING_ARGS = [
    "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000", "--save", CKPT, "--load", CKPT,
    "--eval-iters", "10", "--tensorboard-dir", TB,
]
GPT_DATA_ARGS = ["--data-path", "$DATA_PATH", "--vocab-file", "$VOCAB_FILE", "--merge-file", "$MERGE_FILE",
                 "--split", "949,50,1"]
# The part of TRAINING_ARGS both GPT-3 scripts share, after the batch sizes and --train-iters.
GPT3_OPTIMIZER_ARGS = [
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006",
    "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
    "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
]
GPT_175B = [
    "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
    "--max-position-embeddings", "2048", "--attention-backend", "auto",
    "--micro-batch-size", "1", "--global-batch-size", "1536", "--rampup-batch-size", "16", "16", "5859375",
    "--train-iters", "500000", *GPT3_OPTIMIZER_ARGS,
    "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
    *GPT_DATA_ARGS, *EVAL_AND_LOGGING_ARGS,
]
GPT_857M = [
    "--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
    "--max-position-embeddings", "2048", "--attention-backend", "auto",
    "--micro-batch-size", "8", "--global-batch-size", "128", "--train-iters", "500000", *GPT3_OPTIMIZER_ARGS,
    "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "1",
    *GPT_DATA_ARGS, *EVAL_AND_LOGGING_ARGS,
]
BERT_340M = [
    "--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "512",
    "--max-position-embeddings", "512", "--attention-backend", "auto",
    "--micro-batch-size", "4", "--global-batch-size", "32", "--train-iters", "1000000", "--weight-decay", "1e-2",
    "--clip-grad", "1.0", "--fp16", "--lr", "0.0001", "--lr-decay-iters", "990000", "--lr-decay-style", "linear",
    "--min-lr", "1.0e-5", "--weight-decay", "1e-2", "--lr-warmup-fraction", ".01", "--clip-grad", "1.0",
    "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
    "--data-path", "$DATA_PATH", "--vocab-file", "$VOCAB_FILE", "--split", "949,50,1",
    *EVAL_AND_LOGGING_ARGS,
]

# (flag, Megatron-LM's value) -> shrunk value; a value not listed stays as it is.
SHRINK = {
    ("--num-layers", "96"): "2", ("--num-layers", "24"): "2",
    ("--hidden-size", "12288"): "64", ("--hidden-size", "1024"): "64",
    ("--num-attention-heads", "96"): "4", ("--num-attention-heads", "16"): "4",
    ("--seq-length", "2048"): "32", ("--seq-length", "512"): "32",
    ("--max-position-embeddings", "2048"): "32", ("--max-position-embeddings", "512"): "32",
    ("--micro-batch-size", "8"): "1", ("--micro-batch-size", "4"): "1",
    ("--global-batch-size", "1536"): "6", ("--global-batch-size", "128"): "2", ("--global-batch-size", "32"): "2",
    # Long enough for --fp16's loss scale to come down from Megatron's 2^32 (one halving per
    # overflowing step) and then apply updates.
    ("--train-iters", "500000"): "24", ("--train-iters", "1000000"): "24",
    ("--lr-decay-iters", "430000"): "24", ("--lr-decay-iters", "990000"): "24",
    ("--tensor-model-parallel-size", "8"): "1", ("--pipeline-model-parallel-size", "16"): "2",
    ("--log-interval", "100"): "1", ("--save-interval", "10000"): "12", ("--eval-interval", "1000"): "12",
    ("--eval-iters", "10"): "1",
}
RAMPUP = ("16", "16", "5859375"), ("2", "2", "8")  # start, increment, samples
DATA_FLAGS = ("--data-path", "--vocab-file", "--merge-file")  # replaced by --mock-data
LOCAL = ["--mock-data", "--pipeline-executor", "emulator", "--device", "cpu", "--num-threads", "1"]


def shrink(flags: list[str], tmp: Path) -> list[str]:
    """The flag set with sizes shrunk, data mocked and paths under ``tmp``."""
    out: list[str] = []
    i = 0
    while i < len(flags):
        flag = flags[i]
        if flag == "--rampup-batch-size":
            assert tuple(flags[i + 1:i + 4]) == RAMPUP[0]
            out += [flag, *RAMPUP[1]]
            i += 4
            continue
        value = flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else None
        i += 1 if value is None else 2
        if flag in DATA_FLAGS:
            continue
        if value is not None:
            value = SHRINK.get((flag, value), value).replace(CKPT, str(tmp / "ckpt")).replace(TB, str(tmp / "tb"))
        out += [flag] if value is None else [flag, value]
    return out + LOCAL


@pytest.mark.parametrize("flags,task", [(GPT_175B, GPTTask()), (GPT_857M, GPTTask()), (BERT_340M, BertTask())],
                         ids=["gpt3-175b", "gpt3-857m", "bert-340m"])
def test_megatron_example_flag_set_runs(flags, task, tmp_path):
    log = tmp_path / "log.jsonl"
    argv = [*shrink(flags, tmp_path), "--log-json", str(log)]
    workers = emulate(argv, task)
    train_iters = int(argv[argv.index("--train-iters") + 1])
    records = [r for r in map(json.loads, log.read_text().splitlines()) if "eval_split" not in r]
    assert [r["iteration"] for r in records] == list(range(1, train_iters + 1))
    assert all(math.isfinite(r["loss"]) for r in records)
    # fp16 starts at Megatron's loss scale 2^32: overflowing steps are skipped, the rest applied.
    skipped = [sum(stages) for stages in zip(*(r["skipped_updates"] for r in records))]  # per stage
    assert [w.setup.optimizer.step_count for w in workers] == [train_iters - s for s in skipped]
    assert min(w.setup.optimizer.step_count for w in workers) >= 1
    assert records[-1]["loss_scale"][0] < 2.0 ** 32
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(train_iters)
    assert any((tmp_path / "tb").iterdir())
    # Running it again resumes from the checkpoint (--load) and finds nothing left to train.
    with pytest.raises(SystemExit):
        emulate(argv, task)


def test_gpt3_175b_flag_set_runs_tensor_parallel_on_4_ranks(tmp_path):
    tp2 = [*shrink(GPT_175B, tmp_path / "tp2"), "--tensor-model-parallel-size", "2",
           "--pipeline-model-parallel-size", "2", "--pipeline-executor", "distributed"]
    records, params = run_pretrain(tp2, tmp_path / "tp2")
    train_iters = int(tp2[tp2.index("--train-iters") + 1])
    assert [r["iteration"] for r in records] == list(range(1, train_iters + 1))
    assert all(math.isfinite(r["loss"]) for r in records)
    saved = tmp_path / "tp2" / "ckpt" / f"iter_{train_iters:07d}"
    assert sorted(f.name for f in saved.glob("*.pt")) == [f"stage0{s}_dp0_tp{t}.pt" for s in (0, 1) for t in (0, 1)]
    log = tmp_path / "tp1.jsonl"
    emulate([*shrink(GPT_175B, tmp_path / "tp1"), "--log-json", str(log)], GPTTask())
    reference = [r for r in map(json.loads, log.read_text().splitlines()) if "eval_split" not in r]
    # The same fp16 overflows, so the same skipped updates and loss scales on every stage.
    assert [r["skipped_updates"] for r in records] == [r["skipped_updates"] for r in reference]
    assert [r["loss_scale"] for r in records] == [r["loss_scale"] for r in reference]
    assert records[-1]["loss_scale"][0] < 2.0 ** 32
    # fp16 rounds the row-parallel partial sums before their all-reduce: close, not equal.
    for ours, ref in zip(records, reference):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=3e-3)
