"""A table of bad inputs: each is refused up front with one line, a non-zero exit, no rank
started and nothing left behind.

Flag, data, tokenizer, path and checkpoint cases run ``pretrain()`` itself in this process
(what ``pretrain_gpt.py`` runs) with its three ways of starting work (the local launcher,
the distributed runtime, the emulator) replaced by a tripwire: a case passes only if the
refusal comes before any of them. The tools' cases call their ``main()``; a few cases run
the real commands as subprocesses, where interpreter-exit output (megatron-core's
``__del__`` tracebacks) would show.

"Nothing left behind": every case runs in a fresh working directory, and the files under
its temporary directory (inputs included) are the same before and after.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy
import pytest

from async_helpers import REPO, emulate

from megatron.trainer.checkpointing import checkpoint as ckpt
from megatron.trainer.loop import trainer as training  # pretrain and the names it runs through
from megatron.trainer.config.arguments import build_parser
from megatron.trainer.tasks.bert import BertTask
from megatron.trainer.config.flag_checks import DOMAINS, numeric_actions
from megatron.trainer.tasks.gpt import GPTTask

TINY = ["--num-layers", "2", "--pipeline-model-parallel-size", "2", "--hidden-size", "16",
        "--num-attention-heads", "2", "--seq-length", "8", "--vocab-size", "32", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--train-iters", "4", "--num-threads", "1"]
VOCAB = 32  # token ids of the fixture datasets are below this


# ------------------------------------------------------------------------------ fixtures


def _write_dataset(prefix: Path, documents: list[list[int]]) -> str:
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=DType.optimal_dtype(1000))
    for doc in documents:
        builder.add_document(numpy.array(doc, dtype=numpy.int64), [len(doc)])
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory, megatron_world1) -> dict[str, Path]:
    """Shared, never modified: a good dataset, one with out-of-vocabulary ids, a checkpoint."""
    root = tmp_path_factory.mktemp("inputs")
    rng = numpy.random.default_rng(0)
    good = _write_dataset(root / "good", [list(rng.integers(0, VOCAB, 40)) for _ in range(40)])
    wide = _write_dataset(root / "wide", [list(rng.integers(0, 900, 40)) for _ in range(4)])
    emulate([*TINY, "--pipeline-executor", "emulator", "--save", str(root / "ckpt"), "--exit-interval", "2"])
    return {"root": root, "good": Path(good), "wide": Path(wide), "ckpt": root / "ckpt"}


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


class Spawned(AssertionError):
    """A refused run started work."""


def _tripwire(*_: Any, **__: Any) -> None:
    raise Spawned("a rank, the emulator or the launcher was started")


def _refused(run: Callable[[], Any], where: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``run`` in ``where``; assert the refusal; return its one line."""
    before = _tree(where)
    capsys.readouterr()
    try:
        result = run()
    except SystemExit as exc:
        result = exc.code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert result not in (0, None), f"accepted: {out[-500:]}{err[-500:]}"
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert "Traceback" not in out
    assert _tree(where) == before, "left files behind"
    return lines[0]


@pytest.fixture
def refuse(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """``refuse(argv, task=GPTTask()) -> line``: ``pretrain()`` with tripwires instead of work."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    for name in ("launch_ranks", "run_distributed", "emulate"):
        monkeypatch.setattr(training, name, _tripwire)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)

    def run(argv: list[str], task: Any = None) -> str:
        return _refused(lambda: training.pretrain(task or GPTTask(), argv), tmp_path, capsys)
    return run


# ------------------------------------------------------------------------- numeric flags

NUMERIC = [
    # (extra flags, what the line says)
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--lr", "-0.001", "--min-lr", "-0.01"], "--lr must be >= 0, got -0.001"),
    (["--min-lr", "-1"], "--min-lr must be >= 0, got -1.0"),
    (["--adam-beta1", "1.5"], "--adam-beta1 must be in [0, 1), got 1.5"),
    (["--adam-beta1", "-0.1"], "--adam-beta1 must be in [0, 1), got -0.1"),
    (["--adam-beta2", "1.0"], "--adam-beta2 must be in [0, 1), got 1.0"),
    (["--adam-eps", "0"], "--adam-eps must be > 0, got 0.0"),
    (["--adam-eps=-1e-8"], "--adam-eps must be > 0, got -1e-08"),
    (["--clip-grad", "-1"], "--clip-grad must be >= 0, got -1.0"),
    (["--clip-grad", "nan"], "--clip-grad must be a finite number, got nan"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0, got -0.1"),
    (["--hidden-dropout", "1.0"], "--hidden-dropout must be in [0, 1), got 1.0"),
    (["--attention-dropout", "-0.1"], "--attention-dropout must be in [0, 1), got -0.1"),
    (["--hidden-dropout", "nan"], "--hidden-dropout must be a finite number, got nan"),
    (["--init-method-std", "0"], "--init-method-std must be > 0, got 0.0"),
    (["--init-method-std", "-0.02"], "--init-method-std must be > 0, got -0.02"),
    (["--num-layers", "0"], "--num-layers must be >= 1, got 0"),
    (["--hidden-size", "0"], "--hidden-size must be >= 1, got 0"),
    (["--num-attention-heads", "0"], "--num-attention-heads must be >= 1, got 0"),
    (["--seq-length", "-8"], "--seq-length must be >= 1, got -8"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
    (["--global-batch-size", "0"], "--global-batch-size must be >= 1, got 0"),
    (["--train-iters", "0"], "--train-iters must be >= 1, got 0"),
    (["--vocab-size", "0"], "--vocab-size must be >= 1, got 0"),
    (["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by must be >= 1, got 0"),
    (["--ffn-hidden-size", "0"], "--ffn-hidden-size must be >= 1, got 0"),
    (["--num-query-groups", "0"], "--num-query-groups must be >= 1, got 0"),
    (["--max-position-embeddings", "0"], "--max-position-embeddings must be >= 1, got 0"),
    (["--pipeline-model-parallel-size", "0"], "--pipeline-model-parallel-size must be >= 1, got 0"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be >= 1, got 0"),
    (["--data-parallel-size", "0"], "--data-parallel-size must be >= 1, got 0"),
    (["--seed", "-1"], "--seed must be in [0, 4294967295], got -1"),
    (["--seed", str(2**32)], "--seed must be in [0, 4294967295], got 4294967296"),
    (["--lr-warmup-iters", "-1"], "--lr-warmup-iters must be >= 0, got -1"),
    (["--lr-decay-iters", "0"], "--lr-decay-iters must be >= 1, got 0"),
    (["--log-interval", "0"], "--log-interval must be >= 1, got 0"),
    (["--eval-interval", "0"], "--eval-interval must be >= 1, got 0"),
    (["--eval-iters", "-1"], "--eval-iters must be >= 0, got -1"),
    (["--save-interval", "0"], "--save-interval must be >= 1, got 0"),
    (["--exit-interval", "-5"], "--exit-interval must be >= 1, got -5"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be > 0, got 0.0"),
    (["--pipeline-timeout-seconds", "-1"], "--pipeline-timeout-seconds must be > 0, got -1.0"),
    (["--pipeline-timeout-seconds", "inf"], "--pipeline-timeout-seconds must be a finite number, got inf"),
    (["--num-threads", "0"], "--num-threads must be >= 1, got 0"),
    (["--pipeline-schedule", "zb-2p", "--zb-profile-iters", "-1"], "--zb-profile-iters must be >= 0, got -1"),
    (["--pipeline-schedule", "zb-2p", "--zb-memory-limit", "0"], "--zb-memory-limit must be > 0, got 0.0"),
    (["--pipeline-schedule", "auto", "--zb-memory-limit", "0.5"], "--zb-memory-limit must be at least 1"),
    (["--pipeline-schedule", "auto", "--zb-costs", "1,1,1,0", "--zb-profile-iters", "2"],
     "--zb-costs fixes the costs; it excludes profiling"),
    (["--pipeline-schedule", "auto-async", "--enable-optimizer-post-validation"],
     "auto-async: optimizer post-validation needs a synchronous step"),
    (["--pipeline-schedule", "auto-async", "--fp16"], "--fp16 with --pipeline-schedule auto-async"),
    (["--pipeline-schedule", "auto", "--pipemare-lr-anneal-iters", "4"], "--pipemare-lr-anneal-iters needs"),
    (["--pipeline-schedule", "automatic"], "unknown pipeline schedule 'automatic'"),
    (["--pipeline-schedule", "pipemare", "--pipemare-discrepancy-decay", "1.5"],
     "--pipemare-discrepancy-decay must be in (0, 1), got 1.5"),
    (["--pipeline-schedule", "pipemare", "--pipemare-lr-anneal-iters", "0"],
     "--pipemare-lr-anneal-iters must be >= 1, got 0"),
    (["--pipeline-layer-split", "2", "0"], "--pipeline-layer-split must be >= 1, got 0"),
    (["--num-layers-per-virtual-pipeline-stage", "0"], "--num-layers-per-virtual-pipeline-stage must be >= 1, got 0"),
    (["--pipeline-partition-memory-gb", "-1"], "--pipeline-partition-memory-gb must be > 0, got -1.0"),
    (["--optimizer", "basis-rotation", "--rotation-refresh-interval", "-1"],
     "--rotation-refresh-interval must be >= 0, got -1"),
    (["--fp16", "--loss-scale", "-4"], "--loss-scale must be > 0, got -4.0"),
    (["--fp16", "--initial-loss-scale", "nan"], "--initial-loss-scale must be a finite number, got nan"),
    (["--fp16", "--hysteresis", "0"], "--hysteresis must be >= 1, got 0"),
    # argparse's own refusals, one line too
    (["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
    (["--num-layers", "2.5"], "argument --num-layers: invalid int value: '2.5'"),
    (["--pipeline-layer-split", "1", "x"], "invalid int value: 'x'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--pipeline-executor", "gpu"], "argument --pipeline-executor: invalid choice: 'gpu'"),
    # cross-flag rules
    (["--min-lr", "0.1", "--lr", "0.01"], "--min-lr 0.1 is larger than --lr 0.01"),
    (["--hidden-size", "15"], "--hidden-size 15 is not divisible by --num-attention-heads 2"),
    (["--num-layers", "3"], "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
    (["--global-batch-size", "3", "--micro-batch-size", "2"], "--global-batch-size 3 is not divisible"),
    (["--lr-warmup-iters", "50"], "--lr-warmup-iters exceeds --lr-decay-iters"),
    (["--inject-nonfinite-grad", "x:y"], "--inject-nonfinite-grad expects STAGE:UPDATE"),
]

# Megatron-LM's split flags (megatron_split_args): TINY has 2 layers on 2 stages
SPLIT_FLAGS = [
    (["--decoder-first-pipeline-num-layers", "0"], "--decoder-first-pipeline-num-layers must be >= 1, got 0"),
    (["--num-layers", "5", "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "2"],
     "leave 2 layers of --num-layers 5 for 0 middle stages"),
    (["--num-layers", "3", "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"],
     "--num-layers 3 + 2 (--account-for-embedding-in-pipeline-split/--account-for-loss-in-pipeline-split) is not divisible"),
    (["--account-for-embedding-in-pipeline-split", "--decoder-last-pipeline-num-layers", "1"],
     "cannot be combined with --account-for-embedding-in-pipeline-split/--account-for-loss-in-pipeline-split"),
    (["--decoder-first-pipeline-num-layers", "1", "--pipeline-layer-split", "1", "1"],
     "--decoder-first-pipeline-num-layers sets the layer split; drop --pipeline-layer-split"),
    (["--pipeline-model-parallel-layout", "Et|tL", "--decoder-first-pipeline-num-layers", "1"],
     "--pipeline-model-parallel-layout cannot be combined with --decoder-first-pipeline-num-layers"),
    (["--pipeline-model-parallel-layout", "Et|tL", "--pipeline-partition", "even"],
     "--pipeline-model-parallel-layout sets the layer split; drop --pipeline-partition"),
    (["--pipeline-model-parallel-layout", "Et|t|tL"], "has 3 stages, not a multiple of --pipeline-model-parallel-size 2"),
    (["--pipeline-model-parallel-layout", "Et|tmL"], "MTP layers (m) are not supported here"),
    (["--pipeline-model-parallel-layout", "Et|tx"], "unknown layer 'x'"),
    (["--pipeline-model-parallel-layout", "tE|tL"], "E must open the first stage and L close the last"),
    (["--pipeline-model-parallel-layout", "Et|t"], "needs exactly one E and one L"),
    (["--pipeline-model-parallel-layout", "Et|ttL"], "has 3 transformer layers, --num-layers is 2"),
    (["--pipeline-model-parallel-layout", "E|ttL"], "a stage without transformer layers is not supported here"),
    (["--num-layers", "6", "--pipeline-model-parallel-layout", "Et|t|tt|ttL", "--pipeline-schedule", "interleaved-1f1b"],
     "only the same number of layers in every virtual stage maps onto the interleaved chunks"),
    (["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1", "--decoder-first-pipeline-num-layers", "2"],
     "Megatron-LM needs --num-virtual-stages-per-pipeline-rank for uneven virtual stages"),
]


@pytest.mark.parametrize("flags,says", SPLIT_FLAGS, ids=[" ".join(f) for f, _ in SPLIT_FLAGS])
def test_megatron_split_flags_are_refused_up_front(refuse, flags: list[str], says: str) -> None:
    assert says in refuse([*TINY, *flags])


@pytest.mark.parametrize("flags,says", NUMERIC, ids=[" ".join(f) for f, _ in NUMERIC])
def test_flag_values_are_refused_up_front(refuse, flags: list[str], says: str) -> None:
    assert says in refuse([*TINY, *flags])


def test_every_numeric_flag_has_a_domain() -> None:
    """A new type=int/float flag must say where it lives (flag_checks.DOMAINS)."""
    for task in (GPTTask(), BertTask()):
        parser = build_parser()
        task.add_arguments(parser)
        missing = [a.option_strings[-1] for a in numeric_actions(parser) if a.dest not in DOMAINS]
        assert not missing, f"add these flags to megatron.trainer.config.flag_checks.DOMAINS: {missing}"


def test_bert_task_flags_are_range_checked(refuse) -> None:
    assert "--mask-prob must be in (0, 1), got 1.5" in refuse([*TINY, "--mask-prob", "1.5"], BertTask())
    sp = [*TINY, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert "--sequence-parallel is implemented for GPT only" in refuse(sp, BertTask())


# --------------------------------------------------------------------------- list flags

SPLITS = [
    ("80,abc", "'abc' is not a number"),
    ("80,-10,30", "shares must be finite and >= 0"),
    ("0,50,50", "the training share must be positive"),
    ("1,2,3,4", "expected up to three comma-separated numbers"),
    ("nan,1,1", "shares must be finite and >= 0"),
    ("", "expected up to three comma-separated numbers"),
    ("80,,20", "'' is not a number"),
]


@pytest.mark.parametrize("split,says", SPLITS, ids=[s or "empty" for s, _ in SPLITS])
def test_split_is_parsed_strictly(refuse, split: str, says: str) -> None:
    assert says in refuse([*TINY, "--split", split])


def test_split_is_parsed_strictly_with_real_data_too(refuse, inputs) -> None:
    line = refuse([*TINY, "--data-path", str(inputs["good"]), "--tokenizer-type", "NullTokenizer",
                   "--split", "80,abc"])
    assert "--split '80,abc'" in line


BLENDS = [
    (lambda p: ["0.5", p, "0.5"], "3 items with weights among them"),
    (lambda p: ["0.5", p, "abc", p], "'abc' is not a weight"),
    (lambda p: [p, "0.5", p, "0.5"], "is not a weight"),
    (lambda p: ["0.5", p, "0.5", "0.5"], "'0.5' stands where a dataset prefix belongs"),
    (lambda p: ["-1", p, "2", p], "weights must be finite and >= 0"),
    (lambda p: ["nan", p], "weights must be finite and >= 0"),
    (lambda p: ["0", p, "0", p], "with a positive sum"),
]


@pytest.mark.parametrize("blend,says", BLENDS, ids=[str(i) for i in range(len(BLENDS))])
def test_blends_are_parsed_strictly(refuse, inputs, blend, says: str) -> None:
    argv = [*TINY, "--tokenizer-type", "NullTokenizer", "--data-path", *blend(str(inputs["good"]))]
    assert says in refuse(argv)


# --------------------------------------------------------------------- data and tokenizers


def _broken_copy(src: Path, dst: Path, idx: bytes | None = None, bin_bytes: bytes | None = None) -> str:
    for ext, data in ((".idx", idx), (".bin", bin_bytes)):
        Path(str(dst) + ext).write_bytes(Path(str(src) + ext).read_bytes() if data is None else data)
    return str(dst)


DATA = {
    "missing prefix": (lambda d, src: str(d / "nothing"), "missing"),
    "garbage idx": (lambda d, src: _broken_copy(src, d / "g", idx=os.urandom(200)), "corrupt or not a megatron-core index"),
    "idx magic only": (lambda d, src: _broken_copy(src, d / "m", idx=b"MMIDIDX\x00\x00"), "shorter than its header"),
    "truncated idx": (lambda d, src: _broken_copy(src, d / "t", idx=Path(str(src) + ".idx").read_bytes()[:-7]),
                      "corrupt or truncated index"),
    "truncated bin": (lambda d, src: _broken_copy(src, d / "b", bin_bytes=Path(str(src) + ".bin").read_bytes()[:10]),
                      "truncated"),
    "empty bin": (lambda d, src: _broken_copy(src, d / "e", bin_bytes=b""), "empty (no tokens)"),
}


@pytest.mark.parametrize("case", list(DATA))
def test_bad_data_files(refuse, inputs, tmp_path: Path, case: str) -> None:
    make, says = DATA[case]
    prefix = make(tmp_path, inputs["good"])
    line = refuse([*TINY, "--tokenizer-type", "NullTokenizer", "--data-path", prefix])
    assert says in line and str(Path(prefix).name) in line, line


def test_data_needs_a_tokenizer(refuse, inputs) -> None:
    assert "--data-path needs --tokenizer-type" in refuse([*TINY, "--data-path", str(inputs["good"])])


def test_data_and_mock_data_exclude_each_other(refuse, inputs) -> None:
    assert "mutually exclusive" in refuse([*TINY, "--mock-data", "--data-path", str(inputs["good"]),
                                           "--tokenizer-type", "NullTokenizer"])


def test_token_ids_beyond_the_vocabulary(refuse, inputs) -> None:
    line = refuse([*TINY, "--tokenizer-type", "NullTokenizer", "--data-path", str(inputs["wide"])])
    assert str(inputs["wide"]) in line


def test_no_validation_data_for_evaluation(refuse, inputs) -> None:
    line = refuse([*TINY, "--tokenizer-type", "NullTokenizer", "--data-path", str(inputs["good"]),
                   "--split", "100,0,0", "--eval-interval", "2"])
    assert "leaves no validation sample" in line


def test_data_cache_path_on_a_file(refuse, inputs, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    line = refuse([*TINY, "--tokenizer-type", "NullTokenizer", "--data-path", str(inputs["good"]),
                   "--data-cache-path", str(tmp_path / "f")])
    assert "--data-cache-path" in line


TOKENIZERS = {
    "gpt2 without files": (lambda d: ["--tokenizer-type", "GPT2BPETokenizer"], "GPT2BPETokenizer needs --"),
    "gpt2 missing files": (lambda d: ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(d / "v.json"),
                                      "--merge-file", str(d / "m.txt")], "v.json"),
    "gpt2 garbage vocab": (lambda d: ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                                      _file(d / "bad.json", "{not json"), "--merge-file",
                                      _file(d / "m.txt", "#version: 0.2\n")], "bad.json"),
    "hf missing model": (lambda d: ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                    str(d / "none.json")], "none.json"),
    "hf garbage model": (lambda d: ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                    _file(d / "tok.json", "[1, 2")], "tok.json"),
    "wordpiece missing vocab": (lambda d: ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
                                           str(d / "vocab.txt")], "vocab.txt"),
    "unknown tokenizer": (lambda d: ["--tokenizer-type", "Tiktokenizer9"], "invalid choice"),
}


def _file(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", list(TOKENIZERS))
def test_bad_tokenizers(refuse, tmp_path: Path, case: str) -> None:
    make, says = TOKENIZERS[case]
    assert says in refuse([*TINY, *make(tmp_path)])


# ------------------------------------------------------------------------- output paths


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Path:
    """A directory no file can be created in: chmod 555, or /sys where root ignores modes."""
    path = tmp_path / "ro"
    path.mkdir()
    path.chmod(0o555)
    try:
        (path / "probe").touch()
    except OSError:
        yield path
    else:
        (path / "probe").unlink()
        if not os.path.isdir("/sys"):
            pytest.skip("running as root without /sys: no read-only directory to test with")
        yield Path("/sys")
    path.chmod(0o755)


def test_save_onto_a_regular_file(refuse, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert f"--save {tmp_path / 'file'}: exists and is not a directory" in refuse([*TINY, "--save", str(tmp_path / "file")])


def test_save_below_a_regular_file(refuse, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in refuse([*TINY, "--save", str(tmp_path / "file" / "ckpt")])


def test_save_into_a_read_only_directory(refuse, read_only_dir: Path) -> None:
    assert "not writable" in refuse([*TINY, "--save", str(read_only_dir / "ckpt")])


def test_save_without_room_for_a_checkpoint(refuse, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import collections

    from megatron.trainer.checkpointing import paths as checkpoint_paths

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint_paths.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    line = refuse([*TINY, "--save", str(tmp_path / "ckpt")])
    assert "0.00 GB free, one checkpoint needs about" in line and "parameters with optimizer states" in line


def test_checkpoint_size_estimate_matches_the_model(inputs) -> None:
    """The estimate counts the parameters a real checkpoint holds (within 10 %)."""
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.checkpointing.paths import estimate_parameters

    point = ckpt.find_resume_point(inputs["ckpt"])
    assert point is not None
    import torch

    real = sum(t.numel() for name in (ckpt.rank_file_name(0, 0), ckpt.rank_file_name(1, 0))
               for t in torch.load(point.directory / name, weights_only=False)["model"].values())
    estimate = estimate_parameters(parse_run_plan(TINY))
    assert abs(estimate - real) <= 0.1 * real, (estimate, real)


@pytest.mark.parametrize("flag,kind,says", [
    ("--log-json", "dir", "is a directory, not a file"),
    ("--log-json", "below-file", "is not a directory"),
    ("--tensorboard-dir", "file", "exists and is not a directory"),
    ("--trace-dir", "file", "exists and is not a directory"),
    ("--dump-final-params", "below-file", "is not a directory"),
])
def test_unusable_output_paths(refuse, tmp_path: Path, flag: str, kind: str, says: str) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("x")
    path = {"dir": tmp_path / "d", "file": tmp_path / "f", "below-file": tmp_path / "f" / "out"}[kind]
    line = refuse([*TINY, flag, str(path)])
    assert line.startswith(f"error: {flag} {path}") and says in line, line


def test_log_json_into_a_read_only_directory(refuse, read_only_dir: Path) -> None:
    assert "not writable" in refuse([*TINY, "--log-json", str(read_only_dir / "log.jsonl")])


def test_load_a_regular_file(refuse, tmp_path: Path) -> None:
    (tmp_path / "f.pt").write_bytes(b"x")
    assert "--load" in refuse([*TINY, "--load", str(tmp_path / "f.pt")])


def test_load_a_missing_directory(refuse, tmp_path: Path) -> None:
    assert "no such directory" in refuse([*TINY, "--load", str(tmp_path / "nothing")])


# -------------------------------------------------------------------------- checkpoints


def _damaged(inputs: dict[str, Path], tmp_path: Path, damage: Callable[[Path], None]) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(inputs["ckpt"], root)
    damage(root / "iter_0000002")
    return root


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


CHECKPOINTS = {
    "flipped byte": (lambda d: _flip(d / ckpt.rank_file_name(1, 0)), "is corrupt (SHA-256"),
    "truncated file": (lambda d: (d / ckpt.rank_file_name(0, 0)).write_bytes(b"PK"), "truncated or corrupt"),
    "missing file": (lambda d: (d / ckpt.rank_file_name(0, 0)).unlink(), "is missing"),
    "garbage metadata": (lambda d: (d / ckpt.METADATA).write_text("{"), "missing or corrupt"),
    "garbage pointer": (lambda d: (d.parent / ckpt.POINTER).write_text("two\n"), "not an iteration number"),
    "pointer to nowhere": (lambda d: (d.parent / ckpt.POINTER).write_text("9\n"), "iter_0000009 is missing"),
}


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_bad_checkpoints(refuse, inputs, tmp_path: Path, case: str) -> None:
    damage, says = CHECKPOINTS[case]
    root = _damaged(inputs, tmp_path, damage)
    assert says in refuse([*TINY, "--load", str(root)])


def test_checkpoint_of_another_model(refuse, inputs) -> None:
    assert "--hidden-size 16, this run has 32" in refuse([*TINY, "--hidden-size", "32", "--load", str(inputs["ckpt"])])


def test_tied_checkpoint_into_an_untied_model(refuse, inputs) -> None:
    line = refuse([*TINY, "--untie-embeddings-and-output-weights", "--load", str(inputs["ckpt"])])
    assert "was saved with --untie-embeddings-and-output-weights False, this run has True" in line


def test_checkpoint_at_the_end(refuse, inputs) -> None:
    assert "nothing left to train" in refuse([*TINY, "--train-iters", "2", "--load", str(inputs["ckpt"])])


# -------------------------------------------------------------------------------- tools


def _tool_main(name: str) -> Callable[[list[str]], int]:
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.main


@pytest.fixture(scope="module")
def tools() -> dict[str, Callable[[list[str]], int]]:
    return {name: _tool_main(name) for name in ("preprocess_data", "train_tokenizer")}


def _corpus(tmp_path: Path) -> dict[str, str]:
    files = {
        "bad-utf8": b'{"text": "1 2 3"}\n{"text": "4 5 \xff 6"}\n',
        "blank": b"\n   \n\n",
        "empty": b"",
        "no-text": b'{"text": ""}\n{"text": "  "}\n',
        "bad-json": b'{"text": "1 2"}\n{"text": \n',
        "good": b'{"text": "1 2 3 4"}\n',
    }
    for name, data in files.items():
        (tmp_path / f"{name}.jsonl").write_bytes(data)
    return {name: str(tmp_path / f"{name}.jsonl") for name in files}


PREPROCESS = {
    "not utf-8": (lambda c, d: ["--input", c["bad-utf8"]], "bad-utf8.jsonl:2: not UTF-8 (invalid start byte at byte offset 32"),
    "empty": (lambda c, d: ["--input", c["empty"]], "empty (no non-blank line)"),
    "blank": (lambda c, d: ["--input", c["blank"]], "empty (no non-blank line)"),
    "no tokens": (lambda c, d: ["--input", c["no-text"]], "2 documents but no tokens"),
    "bad json": (lambda c, d: ["--input", c["bad-json"]], "bad-json.jsonl:2: not a JSON object"),
    "missing input": (lambda c, d: ["--input", str(d / "none.jsonl")], "no such file"),
    "missing output dir": (lambda c, d: ["--input", c["good"], "--output-prefix", str(d / "no" / "x")],
                           "directory does not exist"),
    "output prefix is a dir": (lambda c, d: ["--input", c["good"], "--output-prefix", _mkdir(d / "x_text_document.bin", d / "x")],
                               "is a directory"),
    "bad workers": (lambda c, d: ["--input", c["good"], "--workers", "0"], "must be >= 1"),
}


def _mkdir(path: Path, prefix: Path) -> str:
    path.mkdir()
    return str(prefix)


@pytest.mark.parametrize("case", list(PREPROCESS))
def test_preprocess_data_refuses(tools, tmp_path: Path, capsys, monkeypatch, case: str) -> None:
    monkeypatch.chdir(tmp_path)
    corpus = _corpus(tmp_path)
    make, says = PREPROCESS[case]
    argv = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--output-prefix", str(tmp_path / "out"),
            *make(corpus, tmp_path)]
    assert says in _refused(lambda: tools["preprocess_data"](argv), tmp_path, capsys)


def test_preprocess_data_into_a_read_only_directory(tools, tmp_path: Path, read_only_dir: Path, capsys) -> None:
    corpus = _corpus(tmp_path)
    argv = ["--input", corpus["good"], "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
            "--output-prefix", str(read_only_dir / "out")]
    assert "not writable" in _refused(lambda: tools["preprocess_data"](argv), tmp_path, capsys)


TOKENIZER_TOOL = {
    "not utf-8": (lambda c, d: ["--input", c["bad-utf8"]], "bad-utf8.jsonl:2: not UTF-8"),
    "blank": (lambda c, d: ["--input", c["blank"]], "no text (empty or blank)"),
    "empty": (lambda c, d: ["--input", c["empty"]], "no text (empty or blank)"),
    "bad json": (lambda c, d: ["--input", c["bad-json"]], "bad-json.jsonl:2: not a JSON object"),
    "output is a file": (lambda c, d: ["--input", c["good"], "--output-dir", c["good"]], "exists and is not a directory"),
    "vocab too small": (lambda c, d: ["--input", c["good"], "--vocab-size", "10"], "--vocab-size must be at least 258"),
}


@pytest.mark.parametrize("case", list(TOKENIZER_TOOL))
def test_train_tokenizer_refuses(tools, tmp_path: Path, capsys, monkeypatch, case: str) -> None:
    monkeypatch.chdir(tmp_path)
    corpus = _corpus(tmp_path)
    make, says = TOKENIZER_TOOL[case]
    argv = ["--output-dir", str(tmp_path / "tok"), "--vocab-size", "300", *make(corpus, tmp_path)]
    assert says in _refused(lambda: tools["train_tokenizer"](argv), tmp_path, capsys)


def test_train_tokenizer_into_a_read_only_directory(tools, tmp_path: Path, read_only_dir: Path, capsys) -> None:
    corpus = _corpus(tmp_path)
    argv = ["--input", corpus["good"], "--output-dir", str(read_only_dir / "tok")]
    assert "not writable" in _refused(lambda: tools["train_tokenizer"](argv), tmp_path, capsys)


# ------------------------------------------------------------------- real commands (few)


def _command(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**env, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"})


def _one_line(proc: subprocess.CompletedProcess, where: Path, before: list[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert "[megatron-async]" not in proc.stdout and "iteration" not in proc.stdout  # no rank ran
    assert _tree(where) == before
    return lines[0]


def test_launcher_refuses_before_spawning(tmp_path: Path) -> None:
    before = _tree(tmp_path)
    proc = _command([str(REPO / "pretrain_gpt.py"), *TINY, "--lr", "nan"], tmp_path)
    assert "--lr must be a finite number, got nan" in _one_line(proc, tmp_path, before)


def test_garbage_idx_is_one_line_without_a_del_traceback(refuse, inputs, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron-core's ``IndexedDataset.__del__`` on a half-built object would report an
    ignored exception through ``sys.unraisablehook`` (a traceback after our line)."""
    import gc

    ignored: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)
    for garbage in (b"MMIDIDX\x00\x00" + os.urandom(60), os.urandom(300), b""):
        prefix = _broken_copy(inputs["good"], tmp_path / "g", idx=garbage)
        assert "corrupt" in refuse([*TINY, "--tokenizer-type", "NullTokenizer", "--data-path", prefix])
        gc.collect()
    assert not ignored, [str(u.exc_value) for u in ignored]


def test_tool_reports_bad_encoding_as_one_line(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path)
    before = _tree(tmp_path)
    proc = _command([str(REPO / "tools" / "train_tokenizer.py"), "--input", corpus["bad-utf8"],
                     "--output-dir", str(tmp_path / "tok"), "--vocab-size", "300"], tmp_path)
    line = _one_line(proc, tmp_path, before)
    assert "bad-utf8.jsonl:2: not UTF-8" in line and "byte offset 32" in line


# ------------------------------------------------------------------- activation recompute

FULL = ["--recompute-granularity", "full"]
RECOMPUTE = [
    (["--recompute-num-layers", "0", *FULL, "--recompute-method", "block"], "--recompute-num-layers must be >= 1, got 0"),
    (["--recompute-granularity", "partial"], "argument --recompute-granularity: invalid choice: 'partial'"),
    (["--recompute-method", "even", *FULL], "argument --recompute-method: invalid choice: 'even'"),
    (FULL, "--recompute-granularity full needs --recompute-method uniform or block"),
    ([*FULL, "--recompute-method", "uniform"], "--recompute-granularity full needs --recompute-num-layers N"),
    (["--recompute-method", "block"], "--recompute-method needs --recompute-granularity full or selective"),
    (["--recompute-num-layers", "1"], "--recompute-num-layers needs --recompute-granularity full or selective"),
    (["--recompute-stash-weights"], "--recompute-stash-weights needs --recompute-granularity full or selective"),
    (["--recompute-activations", *FULL], "--recompute-activations is selective recompute; it contradicts"),
    (["--recompute-activations", "--recompute-method", "uniform"], "--recompute-method is not supported with "
     "--recompute-granularity selective"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"],
     "--recompute-num-layers is for --recompute-granularity full"),
    (["--recompute-activations", "--recompute-modules", "mlp"], "--recompute-modules mlp is not implemented"),
    (["--recompute-activations", "--recompute-stash-weights"], "--recompute-stash-weights needs --recompute-granularity full"),
    ([*FULL, "--recompute-method", "block", "--recompute-num-layers", "1", "--recompute-modules", "core_attn"],
     "--recompute-modules is for --recompute-granularity selective"),
    # per model chunk: TINY has one layer per stage
    ([*FULL, "--recompute-method", "block", "--recompute-num-layers", "2"],
     "--recompute-num-layers 2 exceeds the 1 layers per model chunk"),
    (["--num-layers", "6", *FULL, "--recompute-method", "uniform", "--recompute-num-layers", "2"],
     "--recompute-num-layers 2 must divide the layers of every model chunk with --recompute-method uniform (a chunk has 3)"),
    (["--num-layers", "4", "--pipeline-layer-split", "1", "3", *FULL, "--recompute-method", "uniform",
      "--recompute-num-layers", "3"], "must divide the layers of every model chunk"),
    (["--num-layers", "8", "--pipeline-schedule", "interleaved-1f1b", "--num-layers-per-virtual-pipeline-stage", "2",
      *FULL, "--recompute-method", "block", "--recompute-num-layers", "3"], "exceeds the 2 layers per model chunk"),
    (["--pipeline-partition", "auto", *FULL, "--recompute-method", "block", "--recompute-num-layers", "1"],
     "--pipeline-partition profiled splits layers costed without recompute"),
    (["--distribute-saved-activations"], "--distribute-saved-activations is not supported: the recompute here"),
    (["--pipeline-schedule", "zb-2p", "--zb-memory-limit", "4", *FULL, "--recompute-method", "block",
      "--recompute-num-layers", "1"], "--zb-memory-limit cannot bound memory under --recompute-granularity full"),
]


@pytest.mark.parametrize("flags,says", RECOMPUTE, ids=[" ".join(f) for f, _ in RECOMPUTE])
def test_bad_recompute_flags_are_refused_up_front(refuse, flags: list[str], says: str) -> None:
    assert says in refuse([*TINY, *flags])


# ------------------------------------------------------------- V-shape schedules (issue 31)

V4 = ["--num-layers", "4", "--global-batch-size", "4"]  # 2 stages x 2 V chunks, one layer each
V_SHAPE = [
    (["--num-layers", "6", "--pipeline-schedule", "zb-v"], "6 does not split evenly into the 4 model parts"),
    (["--num-layers", "6", "--pipeline-schedule", "v-half", "--pipeline-layer-split", "3", "3"],
     "do not halve into its two V chunks"),
    ([*V4, "--pipeline-schedule", "v-min", "--global-batch-size", "1"], "v-min: needs at least 2 micro-batches"),
    ([*V4, "--pipeline-schedule", "dualpipev", "--global-batch-size", "2"], "dualpipev: needs at least 4 micro-batches"),
    ([*V4, "--pipeline-schedule", "zb-v", "--global-batch-size", "1"], "zb-v: needs at least 2 micro-batches"),
    ([*V4, "--pipeline-schedule", "v-quarter"], "unknown pipeline schedule 'v-quarter'"),
    # the building blocks and DualPipeV fix their memory (no limit to set) and do not profile
    ([*V4, "--pipeline-schedule", "v-half", "--zb-memory-limit", "3"], "--zb-memory-limit needs --pipeline-schedule"),
    ([*V4, "--pipeline-schedule", "dualpipev", "--zb-memory-limit", "3"], "--zb-memory-limit needs --pipeline-schedule"),
    ([*V4, "--pipeline-schedule", "v-min", "--zb-profile-iters", "2"], "--zb-profile-iters needs --pipeline-schedule"),
    ([*V4, "--pipeline-schedule", "zb-v", "--zb-memory-limit", "1"], "memory limit 1 M_B is below 2"),
    ([*V4, "--pipeline-schedule", "v-half", "--zb-costs", "1,1,1,0"], "--zb-costs"),
    ([*V4, "--pipeline-schedule", "dualpipev", "--num-layers-per-virtual-pipeline-stage", "1"],
     "--num-layers-per-virtual-pipeline-stage"),
    ([*V4, "--pipeline-schedule", "v-min", "--pipeline-model-parallel-size", "1"], "at least 2 pipeline stages"),
    # recompute counts layers per V chunk: 4 layers on 2 stages are 1 per chunk
    ([*V4, "--pipeline-schedule", "zb-v", *FULL, "--recompute-method", "block", "--recompute-num-layers", "2"],
     "--recompute-num-layers 2 exceeds the 1 layers per model chunk"),
]


@pytest.mark.parametrize("flags,says", V_SHAPE, ids=[" ".join(f) for f, _ in V_SHAPE])
def test_bad_v_shape_flags_are_refused_up_front(refuse, flags: list[str], says: str) -> None:
    assert says in refuse([*TINY, *flags])


# ------------------------------------------------------- resharded checkpoints (another layout)

RESHARD_REFUSALS = {
    # a checkpoint of another model, loaded into another layout too
    "other vocabulary": (["--pipeline-model-parallel-size", "1", "--vocab-size", "64"], "--vocab-size 32, this run has 64"),
    "other model shape": (["--pipeline-model-parallel-size", "1", "--hidden-size", "32"], "--hidden-size 16, this run has 32"),
    # the data position (iteration x global batch) would not continue
    "other global batch": (["--pipeline-model-parallel-size", "1", "--global-batch-size", "4"],
                           "global batch of 2 samples, this run has 4"),
}


@pytest.mark.parametrize("case", list(RESHARD_REFUSALS))
def test_resharding_refusals(refuse, inputs, case: str) -> None:
    flags, says = RESHARD_REFUSALS[case]
    assert says in refuse([*TINY, *flags, "--load", str(inputs["ckpt"])])


def test_resharding_with_uneven_update_counts_is_refused(refuse, inputs, tmp_path: Path) -> None:
    """Stage-local steps left the stages at different counts: one optimizer cannot continue both."""
    import json

    def uneven(directory: Path) -> None:
        metadata = json.loads((directory / ckpt.METADATA).read_text())
        metadata["index"][ckpt.rank_file_name(1, 0)]["step_count"] += 1
        (directory / ckpt.METADATA).write_text(json.dumps(metadata))
    root = _damaged(inputs, tmp_path, uneven)
    assert "different update counts" in refuse([*TINY, "--pipeline-model-parallel-size", "1", "--load", str(root)])


def test_resharding_optimizer_state_saved_sharded_is_refused(refuse, inputs, tmp_path: Path) -> None:
    """Files holding parts of the optimizer state (AMDP or distributed-optimizer checkpoints
    written before their saves gathered the shards; marked in the index) load only into their
    own layout: into AMDP (or any other layout) one line before any rank starts. A checkpoint
    with whole states loads into AMDP (tests/test_checkpoint_amdp.py)."""
    import json

    def sharded(directory: Path) -> None:
        metadata = json.loads((directory / ckpt.METADATA).read_text())
        for entry in metadata["index"].values():
            entry["optimizer_sharded"] = True
        (directory / ckpt.METADATA).write_text(json.dumps(metadata))
    root = _damaged(inputs, tmp_path, sharded)
    says = "optimizer state is sharded over replicas (saved before checkpoints gathered the shards)"
    # (the fixture's checkpoint is tied: AMDP, asynchronous, is untied; another layout of 1f1b)
    assert says in refuse([*TINY, "--pipeline-model-parallel-size", "1", "--load", str(root)])


# ------------------------------------------------------- overlapped gradient reduction (ddp_args)

DDP = [
    (["--overlap-grad-reduce", "--ddp-bucket-size", "0"], "--ddp-bucket-size"),
    (["--overlap-grad-reduce", "--ddp-bucket-size", "-5"], "--ddp-bucket-size"),
    (["--ddp-bucket-size", "1000"], "--ddp-bucket-size sizes the buckets of --overlap-grad-reduce"),
    (["--overlap-param-gather"], "needs the distributed optimizer"),
]


@pytest.mark.parametrize("flags,says", DDP, ids=[" ".join(f) for f, _ in DDP])
def test_bad_ddp_flags_are_refused_up_front(refuse, flags: list[str], says: str) -> None:
    assert says in refuse([*TINY, *flags])


# ------------------------------------------------------------- restarts (restart_args: --max-restarts)

RESTARTS = [
    (["--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
    (["--max-restarts", "2"], "--max-restarts needs --save DIR --load DIR with the same DIR"),
    (["--max-restarts", "2", "--save", "ck"], "--max-restarts needs --save DIR --load DIR with the same DIR"),
    (["--max-restarts", "2", "--save", "ck", "--load", "."],
     "--max-restarts needs --save DIR --load DIR with the same DIR"),
    (["--max-restarts", "2", "--save", "ck", "--load", "ck", "--pipeline-executor", "emulator"],
     "--max-restarts restarts the local launcher's ranks; the emulator runs in one process"),
]


@pytest.mark.parametrize("flags,says", RESTARTS, ids=[" ".join(f) for f, _ in RESTARTS])
def test_bad_restart_flags_are_refused_up_front(refuse, flags: list[str], says: str) -> None:
    assert says in refuse([*TINY, *flags])


def test_max_restarts_is_refused_under_torchrun(refuse, monkeypatch) -> None:
    """torchrun's workers are torchrun's to restart (its own --max-restarts)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    says = refuse([*TINY, "--max-restarts", "1", "--save", "ck", "--load", "ck"])
    assert "--max-restarts is the local launcher's: under torchrun pass torchrun --max-restarts" in says


# ------------------------------------------------------------ memory check (issue 28, item 5)


@pytest.mark.parametrize("executor", ["distributed", "emulator"])
def test_run_that_cannot_fit_memory_is_refused(refuse, executor: str) -> None:
    """The issue's 4.4 TB layer: one line naming the estimate and what the host has."""
    line = refuse([*TINY, "--hidden-size", "1048576", "--pipeline-executor", executor])
    assert "memory:" in line and "GiB available" in line and "--no-memory-check" in line, line


def test_run_twice_the_host_memory_is_refused(refuse) -> None:
    """Sized from this host's MemAvailable: two layers of ~192 h^2 parameter bytes each (fp32
    weight, gradient, two AdamW moments; 12 h^2 parameters a layer) hold twice of it."""
    from megatron.trainer.launch.memory_check import host_available_bytes

    h = int((2 * host_available_bytes() / (2 * 12 * 16)) ** 0.5) // 2 * 2
    line = refuse([*TINY, "--hidden-size", str(h)])
    need, have = (float(x.replace(",", "")) for x in re.findall(r"([\d,.]+) GiB", line)[:2])
    assert 1.8 < need / have < 2.6, line  # the layers' 2x, plus embeddings, activations and the baseline


def test_no_memory_check_overrides(refuse) -> None:
    """``--no-memory-check``: the same run gets past every check to the launch (the tripwire)."""
    with pytest.raises(Spawned):
        training.pretrain(GPTTask(), [*TINY, "--hidden-size", "1048576", "--no-memory-check"])


# -------------------------------------------------- schedule check (issue 30, item 4)


@pytest.fixture
def broken_schedules():
    """The broken schedules of ``tests/test_preflight.py``, registered through the public registry."""
    from megatron.pipeline.schedules import SCHEDULES, register
    from test_preflight import OmittedSend, SwappedReceives

    for cls in (SwappedReceives, OmittedSend):
        register(cls)
    yield
    for cls in (SwappedReceives, OmittedSend):
        SCHEDULES.pop(cls.name)


BROKEN = [
    ("broken-swapped-receives", "the schedule cannot run its first iterations: stage 1: F1@s1 expects act(mb1)"),
    ("broken-omitted-send", "the schedule cannot run its first iterations: deadlock: stage 1: blocked at F1@s1, waiting for act(mb1)"),
]


@pytest.mark.parametrize("executor", ["distributed", "emulator"])
@pytest.mark.parametrize("name,says", BROKEN, ids=[name for name, _ in BROKEN])
def test_a_schedule_that_cannot_run_is_refused(refuse, broken_schedules, executor: str, name: str,
                                               says: str) -> None:
    """A deadlock or a misordered message: one line naming the stage and the op, no rank started."""
    line = refuse([*TINY, "--pipeline-schedule", name, "--pipeline-executor", executor])
    assert f"--pipeline-schedule {name}: {says}" in line, line


def test_no_schedule_check_skips_it(refuse, broken_schedules) -> None:
    """``--no-schedule-check``: the broken schedule gets past every check to the launch (the tripwire)."""
    with pytest.raises(Spawned):
        training.pretrain(GPTTask(), [*TINY, "--pipeline-schedule", "broken-omitted-send", "--no-schedule-check"])
