"""Checkpoint / resume: a run stopped at a checkpoint and resumed continues *exactly*.

Reference: the same run trained straight through (it checkpoints at the same iteration, so
its asynchronous schedules drain there too -- a checkpoint ends a segment). Losses and
final parameters must be bitwise equal, for every schedule in the registry (emulator, with
dropout on, so the RNG state must be restored too) and through the distributed runtime.
Then the failure modes: a crash while saving, truncated or corrupt files, and checkpoints
of another model shape, stage count or schedule, each a one-line error naming the file.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from async_helpers import REPO, emulate, eval_records, final_params, run_pretrain, tiny_args

from megatron.pipeline.schedules import SCHEDULES
from megatron.trainer.checkpointing import checkpoint as ckpt
from megatron.trainer.plan.parse import parse_run_plan
from megatron.trainer.tasks.gpt import GPTTask
from megatron.trainer.loop.restart_report import PROGRESS_FILE  # the restart report's progress, beside the checkpoints

TOTAL, STOP = 20, 10

# Every registered schedule, with what it needs at N=2 (4 micro-batches per update).
SCHEDULE_FLAGS: dict[str, tuple[str, ...]] = {
    "1f1b": (), "gpipe": (), "paci": (), "async-1f1b": ("--global-batch-size", "1"), "zb-h1": (), "zb-h2": (), "zb-1p": (), "zb-2p": (),
    "interleaved-1f1b": ("--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"),
    # 4 devices, so every device saves its two pipelines' chunks (replicas of two logical stages)
    "amdp": ("--num-layers", "4", "--pipeline-model-parallel-size", "4"),
    "pipedream-2bw": (),  # the stash crosses the checkpoint (window 10 computes on version 9)
    "pipemare": ("--pipemare-lr-anneal-iters", "8", "--pipemare-discrepancy-decay", "0.1",
                 "--pipemare-sync-warmup-iters", "3"),  # delta crosses the checkpoint
    # V placement: 2 stages x 2 chunks of one layer each
    "zb-v": ("--num-layers", "4"), "v-half": ("--num-layers", "4"), "v-min": ("--num-layers", "4"),
    "dualpipev": ("--num-layers", "4"),
}
CASES = [(name, flags) for name, flags in SCHEDULE_FLAGS.items()] + [
    ("1f1b", ("--enable-optimizer-post-validation",)),
    # fp16 from 2**32: the stage-local loss scales are still backing off at the checkpoint
    ("paci", ("--fp16", "--loss-scale-window", "3")),
]


def test_every_registered_schedule_is_covered() -> None:
    assert set(SCHEDULES) == set(SCHEDULE_FLAGS)


def _argv(schedule: str, extra: tuple[str, ...], log: Path, *more: str) -> list[str]:
    # tiny_args sets --num-layers N; a later --num-layers (interleaving) overrides it.
    return [*tiny_args(2, schedule, 4, TOTAL, "--hidden-dropout", "0.1", "--attention-dropout", "0.1"),
            *extra, "--log-json", str(log), *more]


def _losses(log: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return [(r["iteration"], r["loss"]) for r in records if "loss" in r]


@pytest.mark.parametrize("schedule,extra", CASES, ids=[f"{n}{'+pv' if e and e[0].startswith('--enable') else ''}"
                                                      f"{'+fp16' if '--fp16' in e else ''}" for n, e in CASES])
def test_resumed_run_equals_straight_run_bitwise(megatron_world1, tmp_path: Path, schedule: str,
                                                 extra: tuple[str, ...]) -> None:
    straight_log, resumed_log = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl"
    straight = final_params(emulate(_argv(schedule, extra, straight_log, "--save", str(tmp_path / "a"),
                                          "--save-interval", str(STOP))))
    emulate(_argv(schedule, extra, resumed_log, "--save", str(tmp_path / "b"), "--exit-interval", str(STOP)))
    assert (tmp_path / "b" / ckpt.POINTER).read_text().strip() == str(STOP)
    resumed = final_params(emulate(_argv(schedule, extra, resumed_log, "--load", str(tmp_path / "b"))))

    assert _losses(resumed_log) == _losses(straight_log)
    assert [it for it, _ in _losses(resumed_log)] == list(range(1, TOTAL + 1))
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


def test_zb_2p_post_validation_resumes_with_the_profiled_order(megatron_world1, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """zb-2p profiles its first iterations (wall-clock, so two runs may choose different orders)
    and, with post-validation, the order changes the numbers. The checkpoint keeps the decision:
    resuming the straight run's own iteration-10 checkpoint reproduces its iterations 11-20
    bitwise instead of profiling again (which ran zb-h1 for two more iterations and then
    possibly another order)."""
    extra = ("--enable-optimizer-post-validation", "--zb-profile-iters", "2")
    straight_log, resumed_log = tmp_path / "straight.jsonl", tmp_path / "resumed.jsonl"
    straight = final_params(emulate(_argv("zb-2p", extra, straight_log, "--save", str(tmp_path / "a"),
                                          "--save-interval", str(STOP))))
    middle = ckpt.iteration_dir(tmp_path / "a", STOP)
    state = json.loads((middle / ckpt.METADATA).read_text())["schedule_state"]
    assert state["profile_end"] == 2 and len(state["costs"]) == 2
    shutil.copytree(middle, ckpt.iteration_dir(tmp_path / "b", STOP))
    (tmp_path / "b" / ckpt.POINTER).write_text(f"{STOP}\n")
    capsys.readouterr()
    resumed = final_params(emulate(_argv("zb-2p", extra, resumed_log, "--load", str(tmp_path / "b"))))
    assert "costs profiled" not in capsys.readouterr().out  # the saved decision, not a new profile
    assert _losses(resumed_log) == _losses(straight_log)[STOP:]
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


def test_a_save_removes_stale_staging_and_syncs_before_moving_the_pointer(
        megatron_world1, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Crashed saves' leftovers of any iteration go; every file, the directory rename and the
    pointer are fsync'd, and the pointer moves last."""
    root = tmp_path / "ck"
    for stale in ("iter_0000003.tmp", "iter_0000004.old"):
        (root / stale).mkdir(parents=True)
        (root / stale / "junk.pt").write_bytes(b"x" * 100)
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(f"replace {Path(b).name}"), real_replace(a, b))[1])
    emulate(_argv("1f1b", (), tmp_path / "log.jsonl", "--save", str(root), "--train-iters", "2"))
    assert sorted(p.name for p in root.iterdir()) == sorted([ckpt.POINTER, PROGRESS_FILE, "iter_0000002"])
    assert events[-3:] == ["fsync", f"replace {ckpt.POINTER}", "fsync"]  # file, rename, directory
    renamed = events.index("replace iter_0000002")
    assert events[renamed + 1] == "fsync"  # the directory, before the pointer
    for name in (ckpt.rank_file_name(0, 0), ckpt.rank_file_name(1, 0), ckpt.METADATA):
        at = events.index(f"replace {name}")
        assert events[at - 1] == events[at + 1] == "fsync", name
    meta = json.loads((root / "iter_0000002" / ckpt.METADATA).read_text())
    for name, digest in meta["sha256"].items():
        assert ckpt.file_checksum(root / "iter_0000002" / name) == digest


def test_resume_really_restores_state(megatron_world1, tmp_path: Path) -> None:
    """Control: resuming with a fresh RNG or fresh optimizer moments does change the result,
    so the bitwise test above can fail."""
    log = tmp_path / "log.jsonl"
    emulate(_argv("paci", (), log, "--save", str(tmp_path / "c"), "--exit-interval", str(STOP)))
    reference = final_params(emulate(_argv("paci", (), tmp_path / "r.jsonl", "--load", str(tmp_path / "c"))))
    point = ckpt.find_resume_point(tmp_path / "c")
    assert point is not None
    for damage in ("rng", "optimizer"):
        shutil.copytree(tmp_path / "c", tmp_path / damage)
        path = tmp_path / damage / point.directory.name / ckpt.rank_file_name(0, 0)
        state = torch.load(path, weights_only=False)
        if damage == "rng":
            state["rng"]["cpu"] = torch.Generator().manual_seed(99).get_state()
        else:
            for entry in state["optimizer"]["params"].values():
                entry["exp_avg_sq"].zero_()
        torch.save(state, path)
        meta_path = path.parent / ckpt.METADATA
        meta = json.loads(meta_path.read_text())
        meta["files"][path.name] = path.stat().st_size
        meta["sha256"][path.name] = ckpt.file_checksum(path)
        meta_path.write_text(json.dumps(meta))
        damaged = final_params(emulate(_argv("paci", (), tmp_path / f"{damage}.jsonl", "--load", str(tmp_path / damage))))
        assert any(not torch.equal(reference[k], damaged[k]) for k in reference), damage


@pytest.mark.slow
def test_distributed_resume_equals_straight_run_and_the_emulator(tmp_path: Path) -> None:
    """PACI (asynchronous) through the runtime: stop at a checkpoint, resume in new processes."""
    base = [*tiny_args(2, "paci", 4, TOTAL), "--eval-interval", str(STOP), "--eval-iters", "1", "--device", "cpu"]
    straight, straight_params = run_pretrain([*base, "--save", str(tmp_path / "a"), "--save-interval", str(STOP)],
                                             tmp_path / "straight")
    run_pretrain([*base, "--save", str(tmp_path / "b"), "--exit-interval", str(STOP)], tmp_path / "first")
    resumed, resumed_params = run_pretrain([*base, "--load", str(tmp_path / "b")], tmp_path / "second")
    assert [r["iteration"] for r in resumed] == list(range(STOP + 1, TOTAL + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[STOP:]]
    for name in straight_params:
        assert torch.equal(straight_params[name], resumed_params[name]), name
    # A checkpoint written by the runtime resumes in the emulator to the same numbers.
    emulated = _emulate_in_subprocess([*base, "--load", str(tmp_path / "b")], tmp_path / "emu")
    for name in straight_params:
        assert torch.equal(straight_params[name], emulated[name]), name
    # Evaluation (at 10 and at the end) agrees too, runtime and emulator alike.
    ends = {(r["iteration"], r["eval_split"]): r["eval_loss"] for r in eval_records(tmp_path / "straight")}
    assert sorted(ends) == [(10, "valid"), (20, "test"), (20, "valid")]
    for run in ("second", "emu"):
        resumed_evals = {(r["iteration"], r["eval_split"]): r["eval_loss"] for r in eval_records(tmp_path / run)}
        assert resumed_evals == {k: v for k, v in ends.items() if k[0] == 20}, run


def _emulate_in_subprocess(argv: list[str], out: Path) -> dict[str, torch.Tensor]:
    _, params = run_pretrain([*argv, "--pipeline-executor", "emulator"], out)
    return params


# -- atomicity -------------------------------------------------------------------------------


def test_a_crash_while_saving_leaves_the_last_checkpoint_loadable(megatron_world1, tmp_path: Path) -> None:
    root = tmp_path / "ck"
    emulate(_argv("1f1b", (), tmp_path / "log.jsonl", "--save", str(root), "--exit-interval", "5"))
    # A later save dies after writing one rank file: staging exists, no metadata, no rename.
    staging = ckpt.prepare_staging(root, 10)
    (staging / ckpt.rank_file_name(0, 0)).write_bytes(b"partial")
    point = ckpt.check_resume(GPTTask(), parse_run_plan(_argv("1f1b", (), tmp_path / "x.jsonl", "--load", str(root))))
    assert point is not None and point.iteration == 5
    # The next save of that iteration starts from a clean staging directory.
    emulate(_argv("1f1b", (), tmp_path / "log2.jsonl", "--load", str(root), "--save", str(root),
                  "--exit-interval", "10"))
    assert sorted(p.name for p in root.iterdir()) == sorted([ckpt.POINTER, PROGRESS_FILE, "iter_0000005",
                                                             "iter_0000010"])
    assert sorted(p.name for p in (root / "iter_0000010").iterdir()) == sorted(
        [ckpt.METADATA, ckpt.rank_file_name(0, 0), ckpt.rank_file_name(1, 0)])


def test_load_from_an_empty_directory_starts_fresh(megatron_world1, tmp_path: Path) -> None:
    """Megatron's idiom ``--load X --save X`` starts fresh while X is missing or empty."""
    missing = str(tmp_path / "nothing-yet")
    config = parse_run_plan(_argv("1f1b", (), tmp_path / "x.jsonl", "--load", missing, "--save", missing))
    assert ckpt.check_resume(GPTTask(), config) is None
    (tmp_path / "empty").mkdir()
    config = parse_run_plan(_argv("1f1b", (), tmp_path / "x.jsonl", "--load", str(tmp_path / "empty")))
    assert ckpt.check_resume(GPTTask(), config) is None


# -- one-line errors naming the file ---------------------------------------------------------


@pytest.fixture
def saved(megatron_world1, tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    emulate(_argv("1f1b", (), tmp_path / "log.jsonl", "--save", str(root), "--exit-interval", "3"))
    return root


def _resume_error(root: Path, tmp_path: Path, *flags: str, schedule: str = "1f1b") -> str:
    config = parse_run_plan([*_argv(schedule, (), tmp_path / "x.jsonl", "--load", str(root)), *flags])
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.check_resume(GPTTask(), config)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("flags,schedule,what", [
    (("--hidden-size", "32"), "1f1b", "--hidden-size 16, this run has 32"),
    (("--vocab-size", "64"), "1f1b", "--vocab-size 32, this run has 64"),
    (("--global-batch-size", "8"), "paci", "global batch of 4 samples, this run has 8"),
])
def test_checkpoint_of_another_run_is_refused(saved: Path, tmp_path: Path, flags, schedule, what) -> None:
    message = _resume_error(saved, tmp_path, *flags, schedule=schedule)
    assert what in message and str(saved / "iter_0000003" / ckpt.METADATA) in message


@pytest.mark.parametrize("flags,schedule", [
    (("--pipeline-model-parallel-size", "1", "--num-layers", "2"), "1f1b"), ((), "paci")])
def test_checkpoint_of_another_layout_is_resharded(saved: Path, tmp_path: Path, flags, schedule) -> None:
    """Another stage count or schedule loads by parameter name (tests/test_checkpoint_reshard.py);
    the same layout loads file for file (the bitwise tests above)."""
    config = parse_run_plan([*_argv(schedule, (), tmp_path / "x.jsonl", "--load", str(saved)), *flags])
    point = ckpt.check_resume(GPTTask(), config)
    assert point is not None and point.reshard is not None
    same = ckpt.check_resume(GPTTask(), parse_run_plan(_argv("1f1b", (), tmp_path / "x.jsonl", "--load", str(saved))))
    assert same is not None and same.reshard is None


def test_truncated_rank_file_is_refused_before_any_rank_starts(saved: Path, tmp_path: Path) -> None:
    victim = saved / "iter_0000003" / ckpt.rank_file_name(1, 0)
    victim.write_bytes(victim.read_bytes()[:100])
    message = _resume_error(saved, tmp_path)
    assert f"checkpoint file {victim} is truncated" in message
    # The real command: exit status 2, one line, before spawning ranks.
    argv = [sys.executable, str(REPO / "pretrain_gpt.py"), *_argv("1f1b", (), tmp_path / "y.jsonl"),
            "--load", str(saved)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**env, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "truncated" in lines[0] and str(victim) in lines[0], proc.stderr[-2000:]


def test_corrupt_rank_file_of_the_right_size_names_the_file(saved: Path, tmp_path: Path, megatron_world1) -> None:
    """Caught by its checksum before any rank starts, and again by the rank that loads it."""
    victim = saved / "iter_0000003" / ckpt.rank_file_name(0, 0)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, still a zip torch might read
    victim.write_bytes(bytes(data))
    assert f"checkpoint file {victim} is corrupt (SHA-256" in _resume_error(saved, tmp_path)
    config = parse_run_plan(_argv("1f1b", (), tmp_path / "x.jsonl", "--load", str(saved)))
    point = ckpt.check_resume(GPTTask(), config, verify_files=False)
    assert point is not None
    workers = emulate(_argv("1f1b", (), tmp_path / "z.jsonl", "--train-iters", "1"))
    with pytest.raises(ckpt.CheckpointError, match=f"checkpoint file {victim} is corrupt"):
        ckpt.load_stage_state(GPTTask(), workers[0], point, 0)


def test_pointer_to_a_missing_directory_is_an_error(saved: Path, tmp_path: Path) -> None:
    (saved / ckpt.POINTER).write_text("7\n")
    assert "iter_0000007 is missing" in _resume_error(saved, tmp_path)
