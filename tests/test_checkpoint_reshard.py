"""Reshardable checkpoints: a checkpoint saved at one (pipeline size, data-parallel size, layer
split, schedule) loads into another.

Reference: the run that saved the checkpoint, continued (it saves at iteration 3 and trains on
to 5). The first loss after loading is computed on the loaded weights before any update, so it
must equal the reference's loss at iteration 4 whatever the new layout (≤ 1e-5 relative; the
emulator is bitwise here). Synchronous schedules apply the same update too, so their second
loss matches as well. Tiny GPT, fp32, no dropout.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from async_helpers import TINY_GPT, emulate, run_pretrain

from megatron.trainer.checkpointing import checkpoint as ckpt
from megatron.trainer.checkpointing import load as ckpt_load
from megatron.trainer.checkpointing import reshard
from megatron.trainer.plan.parse import parse_run_plan
from megatron.trainer.tasks.gpt import GPTTask

SAVED, TOTAL = 3, 5


def _argv(pp: int, schedule: str, log: Path, *more: str) -> list[str]:
    return [*TINY_GPT, "--num-layers", "4", "--pipeline-model-parallel-size", str(pp), "--pipeline-schedule", schedule,
            "--global-batch-size", "4", "--train-iters", str(TOTAL), "--log-interval", "1",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-json", str(log),
            "--untie-embeddings-and-output-weights", *more]  # one model for sync and async schedules


def _losses(log: Path) -> dict[int, float]:
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return {r["iteration"]: r["loss"] for r in records if "loss" in r and "eval_split" not in r}


@pytest.fixture(scope="module")
def saved(megatron_world1, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float]]:
    """PP4 1f1b (emulator) saved at iteration 3 and continued to 5: (checkpoint root, its losses)."""
    root = tmp_path_factory.mktemp("pp4")
    emulate(_argv(4, "1f1b", root / "ref.jsonl", "--save", str(root / "all"), "--save-interval", str(SAVED)))
    checkpoint = root / "ck"
    shutil.copytree(ckpt.iteration_dir(root / "all", SAVED), ckpt.iteration_dir(checkpoint, SAVED))
    (checkpoint / ckpt.POINTER).write_text(f"{SAVED}\n")
    return checkpoint, _losses(root / "ref.jsonl")


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * abs(b)


LAYOUTS = {
    "pp2": (2, "1f1b", ()),
    "pp2-split-3-1": (2, "1f1b", ("--pipeline-layer-split", "3", "1")),
    "pp1": (1, "1f1b", ()),
    "pp2-zb-h1": (2, "zb-h1", ()),
    "pp2-paci": (2, "paci", ()),
    "pp2-interleaved": (2, "interleaved-1f1b", ("--num-layers-per-virtual-pipeline-stage", "1")),
    "pp2-2bw": (2, "pipedream-2bw", ()),
    "pp3-auto": (3, "1f1b", ("--pipeline-partition", "auto")),  # profiles, then splits 4 layers over 3
    # V placement: stage 0 holds layers 0 and 3, stage 1 layers 1 and 2 (each stage reads two old files)
    "pp2-zb-v": (2, "zb-v", ()),
    "pp2-v-half": (2, "v-half", ()),
    "pp2-v-min": (2, "v-min", ()),
    "pp2-dualpipev": (2, "dualpipev", ()),
}
SYNCHRONOUS = ("1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "v-half", "v-min", "dualpipev")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resharded_resume_continues_the_saved_run(saved, tmp_path: Path, layout: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint, reference = saved
    pp, schedule, extra = LAYOUTS[layout]
    capsys.readouterr()
    emulate(_argv(pp, schedule, tmp_path / "log.jsonl", "--load", str(checkpoint), *extra))
    out = capsys.readouterr().out
    assert "checkpoint: resharding the checkpoint from PP4 DP1 1f1b to" in out
    losses = _losses(tmp_path / "log.jsonl")
    assert sorted(losses) == list(range(SAVED + 1, TOTAL + 1))
    assert _close(losses[SAVED + 1], reference[SAVED + 1]), (losses, reference)
    if schedule in SYNCHRONOUS:  # the same update, so the next loss too
        assert _close(losses[SAVED + 2], reference[SAVED + 2]), (losses, reference)
    if schedule == "pipedream-2bw":
        assert "weight-version state of pipedream-2bw reset" in out


@pytest.mark.parametrize("into", [(4, "1f1b"), (1, "1f1b"), (2, "v-min")], ids=["pp4-1f1b", "pp1-1f1b", "pp2-v-min"])
def test_a_v_checkpoint_reshards_into_other_schedules(megatron_world1, tmp_path: Path, into: tuple[int, str]) -> None:
    """Saved from dualpipev (V placement, PP2: a stage holds two non-adjacent layers), loaded
    into a chain and into another V schedule: the same next two losses as the saving run."""
    emulate(_argv(2, "dualpipev", tmp_path / "ref.jsonl", "--save", str(tmp_path / "v"), "--save-interval", str(SAVED)))
    reference = _losses(tmp_path / "ref.jsonl")
    (tmp_path / "v" / ckpt.POINTER).write_text(f"{SAVED}\n")
    pp, schedule = into
    emulate(_argv(pp, schedule, tmp_path / "log.jsonl", "--load", str(tmp_path / "v")))
    losses = _losses(tmp_path / "log.jsonl")
    assert sorted(losses) == [SAVED + 1, SAVED + 2]
    assert all(_close(losses[i], reference[i]) for i in losses), (losses, reference)


def test_a_rank_reads_only_the_files_holding_its_parameters(saved, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Split 3+1 out of four one-layer stages: the new stage 0 reads old stages 0-2, stage 1 only 3."""
    checkpoint, _ = saved
    reads: list[str] = []
    real = ckpt_load._read_rank_file
    monkeypatch.setattr(ckpt_load, "_read_rank_file", lambda point, name: (reads.append(name), real(point, name))[1])
    emulate(_argv(2, "1f1b", tmp_path / "log.jsonl", "--load", str(checkpoint), "--pipeline-layer-split", "3", "1"))
    assert reads == [ckpt.rank_file_name(s, 0) for s in range(4)]  # stage 0: files 0, 1, 2; stage 1: file 3


def test_without_optimizer_state_and_finetune(saved, tmp_path: Path) -> None:
    """``--no-load-optim``: the loaded weights (same first loss), a fresh optimizer (two updates, not
    five). ``--finetune`` resharded starts where the same-layout finetune starts."""
    checkpoint, reference = saved
    workers = emulate(_argv(2, "1f1b", tmp_path / "fresh.jsonl", "--load", str(checkpoint), "--no-load-optim"))
    assert _close(_losses(tmp_path / "fresh.jsonl")[SAVED + 1], reference[SAVED + 1])
    assert [w.setup.optimizer.step_count for w in workers] == [TOTAL - SAVED] * 2
    loaded = emulate(_argv(2, "1f1b", tmp_path / "full.jsonl", "--load", str(checkpoint)))
    assert [w.setup.optimizer.step_count for w in loaded] == [TOTAL] * 2

    same = emulate(_argv(4, "1f1b", tmp_path / "ft4.jsonl", "--load", str(checkpoint), "--finetune", "--train-iters", "2"))
    moved = emulate(_argv(2, "1f1b", tmp_path / "ft2.jsonl", "--load", str(checkpoint), "--finetune", "--train-iters", "2"))
    ft4, ft2 = _losses(tmp_path / "ft4.jsonl"), _losses(tmp_path / "ft2.jsonl")
    assert sorted(ft2) == [1, 2] and _close(ft2[1], ft4[1]) and _close(ft2[2], ft4[2])
    assert [w.setup.optimizer.step_count for w in same + moved] == [2] * 6


@pytest.mark.slow
def test_resumes_at_pp2_dp2_distributed(saved, tmp_path: Path) -> None:
    """The emulator's PP4 checkpoint into the runtime at PP2 x DP2 (4 gloo ranks)."""
    checkpoint, reference = saved
    argv = _argv(2, "1f1b", tmp_path / "unused.jsonl", "--load", str(checkpoint), "--data-parallel-size", "2",
                 "--device", "cpu")
    records, _ = run_pretrain(argv[:argv.index("--log-json")] + argv[argv.index("--log-json") + 2:], tmp_path / "dp2")
    losses = {r["iteration"]: r["loss"] for r in records}
    assert sorted(losses) == [SAVED + 1, TOTAL]
    assert _close(losses[SAVED + 1], reference[SAVED + 1]) and _close(losses[TOTAL], reference[TOTAL])


# -- the plan, without training ------------------------------------------------------------------


def _plan_error(checkpoint: Path, tmp_path: Path, *flags: str) -> str:
    config = parse_run_plan(_argv(2, "1f1b", tmp_path / "x.jsonl", "--load", str(checkpoint), *flags))
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.check_resume(GPTTask(), config)
    assert "\n" not in str(info.value)
    return str(info.value)


def _edited(checkpoint: Path, tmp_path: Path, edit) -> Path:
    root = tmp_path / "edited"
    shutil.copytree(checkpoint, root)
    path = ckpt.iteration_dir(root, SAVED) / ckpt.METADATA
    metadata = json.loads(path.read_text())
    edit(metadata)
    path.write_text(json.dumps(metadata))
    return root


def test_refusals_are_one_line(saved, tmp_path: Path) -> None:
    checkpoint, _ = saved
    assert "global batch of 4 samples, this run has 8" in _plan_error(checkpoint, tmp_path, "--global-batch-size", "8")
    assert "--vocab-size 32, this run has 64" in _plan_error(checkpoint, tmp_path, "--vocab-size", "64")
    # AMDP reshards now (its shards are gathered at save, tests/test_checkpoint_amdp.py)
    amdp = parse_run_plan(_argv(4, "amdp", tmp_path / "x.jsonl", "--load", str(checkpoint)))
    assert ckpt.check_resume(GPTTask(), amdp).reshard is not None

    def unequal_counts(metadata: dict) -> None:
        metadata["index"][ckpt.rank_file_name(3, 0)]["step_count"] = 2
    uneven = _edited(checkpoint, tmp_path, unequal_counts)
    assert "different update counts [2, 3]" in _plan_error(uneven, tmp_path)
    config = parse_run_plan(_argv(2, "1f1b", tmp_path / "x.jsonl", "--load", str(uneven), "--no-load-optim"))
    assert ckpt.check_resume(GPTTask(), config) is not None  # a fresh optimizer needs no count

    shutil.rmtree(uneven)
    old = _edited(checkpoint, tmp_path, lambda metadata: metadata.pop("index"))
    assert "has no parameter index" in _plan_error(old, tmp_path)


def test_only_replica_zero_files_are_owners() -> None:
    """A DP2 checkpoint: owners are the DP 0 files; a layout change keeps the stage's own replica
    for per-stage state; the profiled order goes with a partition change."""
    index = {ckpt.rank_file_name(s, d): {"stage": s, "step_count": 7, "params": {f"p{s}": reshard.param_entry("", (2,))}}
             for s in range(2) for d in range(2)}
    signature = {"pipeline_model_parallel_size": 2, "data_parallel_size": 2, "num_microbatches": 2,
                 "micro_batch_size": 1, "pipeline_schedule": "zb-1p"}
    ours = {**signature, "data_parallel_size": 1, "num_microbatches": 4}
    metadata = {"signature": signature, "index": index, "schedule_state": {"costs": []}}
    config = parse_run_plan(_argv(2, "zb-1p", Path("x.jsonl")))
    plan = reshard.plan(metadata, ours, config, "here")
    assert plan.owners == {"p0": ckpt.rank_file_name(0, 0), "p1": ckpt.rank_file_name(1, 0)}
    assert plan.same_partition and plan.stage_file(1, 1) == ckpt.rank_file_name(1, 1)
    assert plan.stage_file(1, 3) == ckpt.rank_file_name(1, 0)
    assert plan.files_read(1) == {ckpt.rank_file_name(0, 0), ckpt.rank_file_name(1, 0)}
    assert plan.files_read(4) == set(index)  # each replica's RNG from its own old file
    moved = reshard.plan(metadata, {**ours, "pipeline_model_parallel_size": 1}, config, "here")
    assert not moved.same_partition and any("profiled order" in n for n in moved.notices)


@pytest.mark.parametrize("rotation,names", [
    (("--optimizer", "basis-rotation", "--rotation-refresh-interval", "2"), "rotated_names"),
    (("--optimizer", "muon", "--muon-use-nesterov"), "orthogonalised_names"),
], ids=["basis-rotation", "muon"])
def test_matrix_optimizer_state_reshards_by_name(megatron_world1, tmp_path: Path, rotation: tuple[str, ...],
                                                 names: str) -> None:
    """Basis rotation keeps its bases and statistics per parameter name, Muon its momentum and
    which weights it orthogonalises: PP4 -> PP2 continues the saved run (with rotation a refresh
    every 2 steps, so iteration 5's update uses the loaded bases)."""
    emulate(_argv(4, "1f1b", tmp_path / "ref.jsonl", *rotation, "--save", str(tmp_path / "all"),
                  "--save-interval", str(SAVED)))
    shutil.copytree(ckpt.iteration_dir(tmp_path / "all", SAVED), ckpt.iteration_dir(tmp_path / "ck", SAVED))
    (tmp_path / "ck" / ckpt.POINTER).write_text(f"{SAVED}\n")
    workers = emulate(_argv(2, "1f1b", tmp_path / "pp2.jsonl", *rotation, "--load", str(tmp_path / "ck")))
    reference, losses = _losses(tmp_path / "ref.jsonl"), _losses(tmp_path / "pp2.jsonl")
    assert all(_close(losses[it], reference[it]) for it in (SAVED + 1, TOTAL)), (losses, reference)
    assert all(getattr(w.setup.optimizer, names) for w in workers)


def test_an_explicit_even_split_is_the_same_partition() -> None:
    even = {"pipeline_model_parallel_size": 2, "num_model_chunks": 1, "num_layers": 4, "pipeline_layer_split": None}
    assert reshard.partition(even) == reshard.partition({**even, "pipeline_layer_split": [2, 2]})
    assert reshard.partition(even) != reshard.partition({**even, "pipeline_layer_split": [3, 1]})
    assert reshard.partition(even) != reshard.partition({**even, "num_model_chunks": 2})


def test_replica_files_other_than_zero_are_not_read(saved, tmp_path: Path) -> None:
    """The PP4 checkpoint dressed up as PP4 x DP2 whose replica-1 files are damaged (a wrong
    SHA-256 in the metadata): loading it at PP2 x DP1 reads and checks replica 0 only."""
    checkpoint, reference = saved

    def second_replica(metadata: dict) -> None:
        metadata["signature"].update(data_parallel_size=2, num_microbatches=2)
        for stage in range(4):
            zero, one = ckpt.rank_file_name(stage, 0), ckpt.rank_file_name(stage, 1)
            shutil.copy(directory / zero, directory / one)
            metadata["files"][one] = metadata["files"][zero]
            metadata["sha256"][one] = "0" * 64
            metadata["index"][one] = metadata["index"][zero]
    directory = ckpt.iteration_dir(tmp_path / "edited", SAVED)
    root = _edited(checkpoint, tmp_path, second_replica)
    emulate(_argv(2, "1f1b", tmp_path / "log.jsonl", "--load", str(root)))
    assert _close(_losses(tmp_path / "log.jsonl")[SAVED + 1], reference[SAVED + 1])
    same_layout = _argv(4, "1f1b", tmp_path / "x.jsonl", "--load", str(root), "--data-parallel-size", "2",
                        "--pipeline-executor", "distributed")
    with pytest.raises(ckpt.CheckpointError, match=r"stage00_dp1.pt is corrupt \(SHA-256"):
        ckpt.check_resume(GPTTask(), parse_run_plan(same_layout))


def test_sharded_optimizer_state_is_marked_and_refused(tmp_path: Path) -> None:
    """A file holding part of a parameter's moments (ZeRO-1 / AMDP shards) is marked in the index,
    and a checkpoint with such files does not reshard its optimizer state."""
    import torch

    model = {"w": torch.zeros(4, 2)}
    whole = {"model": model, "optimizer": {"step_count": 1, "params": {"w": {"exp_avg": torch.zeros(4, 2)}}}}
    part = {"model": model, "optimizer": {"step_count": 1, "params": {"w": {"exp_avg": torch.zeros(3)}}}}
    assert not reshard.file_index(whole)["optimizer_sharded"] and reshard.file_index(part)["optimizer_sharded"]
    signature = {"pipeline_model_parallel_size": 1, "data_parallel_size": 1, "num_microbatches": 4,
                 "micro_batch_size": 1, "pipeline_schedule": "1f1b"}
    metadata = {"signature": signature, "index": {ckpt.rank_file_name(0, 0): reshard.file_index(part)}}
    ours = {**signature, "pipeline_schedule": "paci"}
    with pytest.raises(reshard.ReshardError, match="optimizer state is sharded over replicas"):
        reshard.plan(metadata, ours, parse_run_plan(_argv(2, "paci", Path("x.jsonl"))), "here")
    fresh = parse_run_plan(_argv(2, "paci", Path("x.jsonl"), "--load", str(tmp_path), "--no-load-optim"))
    assert not reshard.plan(metadata, ours, fresh, "here").load_optimizer
