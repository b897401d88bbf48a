"""Bad flag combinations fail with exit status 2 and one ``error: ...`` line naming the flag,
before any process group or rank exists."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.trainer.plan.parse import parse_args

REPO = Path(__file__).resolve().parents[1]

# (argv, a flag the one-line error must name)
BAD = {
    "layers-not-divisible-by-stages": (
        ["--num-layers", "5", "--pipeline-model-parallel-size", "2"], "--num-layers"),
    "global-batch-not-divisible": (
        ["--global-batch-size", "7", "--micro-batch-size", "2"], "--global-batch-size"),
    "global-batch-not-divisible-by-dp": (
        ["--global-batch-size", "6", "--micro-batch-size", "2", "--data-parallel-size", "2"],
        "--global-batch-size"),
    "layer-split-wrong-length": (
        ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--pipeline-layer-split", "1", "1", "2"],
        "--pipeline-layer-split"),
    "layer-split-wrong-sum": (
        ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--pipeline-layer-split", "1", "2"],
        "--pipeline-layer-split"),
    "layer-split-zero-entry": (
        ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--pipeline-layer-split", "0", "4"],
        "--pipeline-layer-split"),
    "unknown-schedule": (["--pipeline-schedule", "no-such-schedule"], "--pipeline-schedule"),
    "hidden-not-divisible-by-heads": (
        ["--hidden-size", "64", "--num-attention-heads", "5"], "--hidden-size"),
    "seq-exceeds-max-positions": (
        ["--seq-length", "128", "--max-position-embeddings", "64"], "--max-position-embeddings"),
    "emulator-with-data-parallel": (
        ["--pipeline-executor", "emulator", "--data-parallel-size", "2"], "--pipeline-executor emulator"),
    "tensor-parallel-emulator": (["--tensor-model-parallel-size", "2", "--pipeline-executor", "emulator"],
                                 "--tensor-model-parallel-size"),
    "min-lr-above-lr": (["--lr", "1e-4", "--min-lr", "1e-3"], "--min-lr"),
}


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # parse_args reads WORLD_SIZE; make the tests independent of the caller's environment.
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def no_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Argument validation must not touch torch.distributed at all."""
    import torch.distributed as dist

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process group was started during argument validation")

    monkeypatch.setattr(dist, "init_process_group", forbidden)
    monkeypatch.setattr(dist, "new_group", forbidden)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_flags_exit_2_with_one_line_naming_the_flag(
    case: str, capsys: pytest.CaptureFixture[str], no_process_group: None
) -> None:
    argv, flag = BAD[case]
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    assert flag in lines[0], err


def test_good_flags_parse(capsys: pytest.CaptureFixture[str], no_process_group: None) -> None:
    """Control: the neighbours of the bad combinations are accepted and derived correctly."""
    args = parse_args([
        "--num-layers", "4", "--pipeline-model-parallel-size", "3", "--pipeline-layer-split", "2", "1", "1",
        "--global-batch-size", "12", "--micro-batch-size", "2", "--pipeline-schedule", "gpipe",
        "--lr", "1e-3", "--min-lr", "1e-3", "--seq-length", "64", "--max-position-embeddings", "64",
    ])
    assert args.num_microbatches == 6
    assert args.data_parallel_size == 1 and args.world_size == 3
    assert args.lr_decay_iters == args.train_iters
    args = parse_args(["--pipeline-executor", "emulator", "--pipeline-model-parallel-size", "8", "--num-layers", "8"])
    assert args.world_size == 8 and args.global_batch_size == args.micro_batch_size
    assert capsys.readouterr() == ("", "")


def test_world_size_mismatch_under_torchrun(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_process_group: None
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit) as info:
        parse_args(["--pipeline-model-parallel-size", "2", "--num-layers", "2"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: WORLD_SIZE=3") and len(err.splitlines()) == 1, err


def test_script_exits_2_without_spawning_ranks(tmp_path: Path) -> None:
    """The real entry point: a bad launch fails fast, before the launcher spawns anyone."""
    log_json = tmp_path / "log.jsonl"
    cmd = [
        sys.executable, str(REPO / "pretrain_gpt.py"),
        "--pipeline-model-parallel-size", "4", "--num-layers", "6",
        "--train-iters", "2", "--log-interval", "1", "--log-json", str(log_json),
    ]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stdout + proc.stderr
    # Imports dominate (~4 s on an idle 2-core machine); the bound leaves room for a busy one.
    assert elapsed < 60, elapsed
    assert "iteration" not in proc.stdout
    assert not log_json.exists()
    # Ranks spawned before validation would each print their own error line.
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("error: --num-layers 6 is not divisible by --pipeline-model-parallel-size 4")
    assert proc.stderr.rstrip().splitlines()[-1] == errors[0]


def _non_default(flag) -> list[str]:
    """argv giving ``flag`` a value other than its default."""
    if flag.action == "store_true":
        return [flag.name]
    if flag.choices:
        return [flag.name, str(next(c for c in flag.choices if c != flag.default))]
    value = {int: "1", float: "0.5"}.get(flag.type, "1,1,1,0")
    assert not flag.is_default(flag.type(value) if flag.type else value), flag.name
    return [flag.name, value]


def test_every_schedule_flag_is_parsed_once_and_refused_elsewhere(capsys: pytest.CaptureFixture[str]) -> None:
    """Derived from the registry: each schedule's flags are on the parser (argparse would refuse a
    second definition), and each is refused with one line under a schedule that does not take it."""
    from megatron.pipeline.schedules import SCHEDULES, flag_groups

    for group, takers in flag_groups().items():
        other = next(name for name in SCHEDULES if name not in takers)
        for flag in group.flags:
            with pytest.raises(SystemExit):
                parse_args(["--pipeline-schedule", other, *_non_default(flag)])
            err = capsys.readouterr().err
            assert len(err.splitlines()) == 1 and err.startswith(f"error: {flag.name} needs "), err
            assert f"got {other}" in err and all(name in err for name in takers), err
