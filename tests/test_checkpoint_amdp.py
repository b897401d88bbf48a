"""AMDP checkpoints reshard: the replicas' optimizer shards are gathered at save (whole state per
logical stage in every file), sliced again on load, and load into any layout.

Reference: a 1F1B PP4 run trained straight to 5 (synchronous), which also saves at 2. An AMDP
PP4 run (D/2 = 2 replicated pipelines, sharded AdamW state) loads that checkpoint and saves
every iteration: a drain per iteration makes each AMDP window the synchronous step over its
T micro-batches (tests/test_amdp.py), so AMDP continues the reference up to summation order
(the replicas' gradient sum), within 1e-5 relative. Every loss after the first depends on the
loaded moments and update count, so the optimizer state is checked with the weights, and a
run with ``--no-load-optim`` shows the check can fail. Tiny GPT, fp32, no dropout, emulator
(the runtime's gather gives the emulator's files bitwise: the slow test).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from async_helpers import emulate, final_params, named_parameters, run_pretrain, tiny_args
from tests.adam_bounds import assert_within_bounds, gpt_gradient_noise, trace_adam

from megatron.trainer.checkpointing import checkpoint as ckpt
from megatron.trainer.plan.parse import parse_run_plan
from megatron.trainer.tasks.gpt import GPTTask

TOTAL = 5
NO_DROPOUT = ("--hidden-dropout", "0", "--attention-dropout", "0")


def _argv(pp: int, schedule: str, log: Path, *more: str) -> list[str]:
    return [*tiny_args(pp, schedule, 4, TOTAL, *NO_DROPOUT), "--num-layers", "4", "--log-json", str(log), *more]


def _losses(log: Path) -> dict[int, float]:
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return {r["iteration"]: r["loss"] for r in records if "loss" in r and "eval_split" not in r}


# AMDP's replicas sum their gradients in another order than 1F1B: tests/adam_bounds.py's rho for
# tiny_args' model (4 layers, hidden 16, FFN 64, vocabulary 32, 8 x 4 tokens per step).
RHO = gpt_gradient_noise(4, 16, 64, 32, 8 * 4)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= RHO * abs(b)


def _only(root: Path, iteration: int, into: Path) -> Path:
    """A checkpoint root holding just ``iteration`` of ``root``."""
    shutil.copytree(ckpt.iteration_dir(root, iteration), ckpt.iteration_dir(into, iteration))
    (into / ckpt.POINTER).write_text(f"{iteration}\n")
    return into


@pytest.fixture(scope="module")
def runs(megatron_world1, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The 1F1B reference (saved at 2) and the AMDP run loaded from it (saved at 3, 4, 5)."""
    root = tmp_path_factory.mktemp("amdp_ckpt")
    with trace_adam() as trace:
        workers = emulate(_argv(4, "1f1b", root / "ref.jsonl", "--save", str(root / "ref"), "--save-interval", "2"))
    reference = final_params(workers)
    bounds = {name: trace.bound(name, p, RHO) for w in workers for name, p in named_parameters(w)}  # see RHO
    _only(root / "ref", 2, root / "ref2")
    amdp = final_params(emulate(_argv(4, "amdp", root / "amdp.jsonl", "--load", str(root / "ref2"),
                                      "--save", str(root / "amdp"), "--save-interval", "1")))
    return {"root": root, "ref": _losses(root / "ref.jsonl"), "ref_params": reference, "bounds": bounds,
            "ref2": root / "ref2",
            "amdp": _losses(root / "amdp.jsonl"), "amdp_params": amdp, "amdp3": _only(root / "amdp", 3, root / "amdp3")}


def test_a_whole_checkpoint_loads_into_amdp_with_its_optimizer_state(runs, tmp_path: Path) -> None:
    """1F1B PP4 -> AMDP PP4: each replica takes its range of the whole state (the resharded path)."""
    ref, amdp = runs["ref"], runs["amdp"]
    assert sorted(amdp) == [3, 4, 5]
    assert all(_close(amdp[it], ref[it]) for it in (3, 4, 5)), (amdp, ref)
    assert_within_bounds(runs["amdp_params"], runs["ref_params"], runs["bounds"])
    # Control: a fresh optimizer moves the weights elsewhere (the losses above can fail).
    emulate(_argv(4, "amdp", tmp_path / "fresh.jsonl", "--load", str(runs["ref2"]), "--no-load-optim",
                  "--exit-interval", "4"))
    fresh = _losses(tmp_path / "fresh.jsonl")
    assert _close(fresh[3], ref[3]) and not _close(fresh[4], ref[4]), (fresh, ref)


def test_files_hold_whole_optimizer_states(runs) -> None:
    """Every AMDP file holds, for each of its D/2 logical stages, every parameter's whole state;
    the index lists nothing as sharded."""
    directory = ckpt.iteration_dir(runs["root"] / "amdp", 3)
    index = json.loads((directory / ckpt.METADATA).read_text())["index"]
    assert len(index) == 4 and not any(entry["optimizer_sharded"] for entry in index.values())
    for stage in range(4):
        state = torch.load(directory / ckpt.rank_file_name(stage, 0), weights_only=False)
        assert state["optimizer"]["params"].keys() == state["model"].keys()
        for name, entry in state["optimizer"]["params"].items():
            assert entry["exp_avg"].shape == entry["exp_avg_sq"].shape == state["model"][name].shape, name
    # Replicas of a parameter on two devices saved the same gathered state, bit for bit.
    states = [torch.load(directory / ckpt.rank_file_name(s, 0), weights_only=False)["optimizer"]["params"]
              for s in range(4)]
    shared = [(a, b, name) for i, a in enumerate(states) for b in states[i + 1:] for name in a.keys() & b.keys()]
    assert shared and all(torch.equal(a[n]["exp_avg_sq"], b[n]["exp_avg_sq"]) for a, b, n in shared)


def test_same_layout_resumes_bitwise(runs, tmp_path: Path) -> None:
    """AMDP PP4 saved at 3 -> AMDP PP4 (file for file, each replica slicing its ranges): losses
    and weights are the uninterrupted AMDP run's bits (same drains: a save every iteration)."""
    workers = emulate(_argv(4, "amdp", tmp_path / "log.jsonl", "--load", str(runs["amdp3"]),
                            "--save", str(tmp_path / "again"), "--save-interval", "1"))
    assert _losses(tmp_path / "log.jsonl") == {it: runs["amdp"][it] for it in (4, 5)}
    resumed = final_params(workers)
    assert resumed.keys() == runs["amdp_params"].keys()
    assert all(torch.equal(resumed[name], value) for name, value in runs["amdp_params"].items())


@pytest.mark.parametrize("pp,schedule", [(2, "1f1b"), (4, "1f1b"), (1, "1f1b"), (2, "amdp")])
def test_an_amdp_checkpoint_loads_into_another_layout(runs, tmp_path: Path, pp: int, schedule: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """AMDP PP4 -> 1F1B PP2 / PP4 / PP1 and AMDP PP2 (one pipeline): the first loss is on the loaded
    weights, the second after a step with the loaded moments (synchronous from there, AMDP
    saving every iteration)."""
    capsys.readouterr()
    more = ("--save", str(tmp_path / "s"), "--save-interval", "1") if schedule == "amdp" else ()
    emulate(_argv(pp, schedule, tmp_path / "log.jsonl", "--load", str(runs["amdp3"]), *more))
    out = capsys.readouterr().out
    assert "resharding the checkpoint from PP4 DP1 amdp to" in out
    assert "stage partition changed" in out  # AMDP device d does not hold part d alone
    losses, ref = _losses(tmp_path / "log.jsonl"), runs["ref"]
    assert sorted(losses) == [4, 5] and all(_close(losses[it], ref[it]) for it in (4, 5)), (losses, ref)


def test_without_optimizer_state_and_finetune(runs, tmp_path: Path) -> None:
    """``--no-load-optim``: loaded weights, fresh optimizer, into AMDP itself and into 1F1B;
    ``--finetune``: weights only from iteration 0, AMDP and 1F1B alike."""
    ref = runs["ref"]
    for pp, schedule in ((4, "amdp"), (2, "1f1b")):
        log = tmp_path / f"{schedule}.jsonl"
        workers = emulate(_argv(pp, schedule, log, "--load", str(runs["amdp3"]), "--no-load-optim"))
        assert _close(_losses(log)[4], ref[4]) and not _close(_losses(log)[5], ref[5])
        assert {w.setup.optimizer.step_count for w in workers} == {TOTAL - 3}
    same = emulate(_argv(4, "amdp", tmp_path / "ft4.jsonl", "--load", str(runs["amdp3"]), "--finetune",
                         "--train-iters", "1"))
    moved = emulate(_argv(2, "1f1b", tmp_path / "ft2.jsonl", "--load", str(runs["amdp3"]), "--finetune",
                          "--train-iters", "1"))
    ft4, ft2 = _losses(tmp_path / "ft4.jsonl"), _losses(tmp_path / "ft2.jsonl")
    assert sorted(ft4) == sorted(ft2) == [1] and _close(ft4[1], ft2[1])
    assert {w.setup.optimizer.step_count for w in same + moved} == {1}


def test_a_checkpoint_saved_sharded_resumes_in_its_layout_and_is_refused_elsewhere(
        runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files written before the gather (each replica's own ranges) still resume in their own
    layout bitwise; into another layout their optimizer state is refused with one line before
    any rank starts, and ``--no-load-optim`` loads the weights."""
    monkeypatch.setattr(ckpt, "whole_optimizer_states", lambda transport, workers: None)
    emulate(_argv(4, "amdp", tmp_path / "old.jsonl", "--load", str(runs["amdp3"]), "--save", str(tmp_path / "old"),
                  "--save-interval", "1", "--exit-interval", "4"))
    monkeypatch.undo()
    index = json.loads((ckpt.iteration_dir(tmp_path / "old", 4) / ckpt.METADATA).read_text())["index"]
    assert all(entry["optimizer_sharded"] for entry in index.values())
    emulate(_argv(4, "amdp", tmp_path / "log.jsonl", "--load", str(tmp_path / "old"), "--save", str(tmp_path / "s"),
                  "--save-interval", "1"))
    assert _losses(tmp_path / "log.jsonl") == {5: runs["amdp"][5]}
    config = parse_run_plan(_argv(2, "1f1b", tmp_path / "x.jsonl", "--load", str(tmp_path / "old")))
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.check_resume(GPTTask(), config)
    assert "sharded over replicas" in str(info.value) and "\n" not in str(info.value)
    config = parse_run_plan(_argv(2, "1f1b", tmp_path / "x.jsonl", "--load", str(tmp_path / "old"), "--no-load-optim"))
    assert ckpt.check_resume(GPTTask(), config) is not None


@pytest.mark.slow
def test_the_runtime_gathers_the_emulators_files(runs, tmp_path: Path) -> None:
    """AMDP PP4 through the runtime (4 gloo ranks, all-gathers over the replica groups) loads
    the 1F1B checkpoint and writes, at 3, the emulator's files' tensors bit for bit."""
    argv = _argv(4, "amdp", tmp_path / "unused.jsonl", "--load", str(runs["ref2"]), "--save", str(tmp_path / "rt"),
                 "--save-interval", "1", "--exit-interval", "3", "--device", "cpu")
    records, _ = run_pretrain(argv[:argv.index("--log-json")] + argv[argv.index("--log-json") + 2:], tmp_path / "run")
    assert [r["loss"] for r in records] == [runs["amdp"][3]]
    for stage in range(4):
        name = ckpt.rank_file_name(stage, 0)
        ours, theirs = (torch.load(ckpt.iteration_dir(root, 3) / name, weights_only=False)
                        for root in (tmp_path / "rt", runs["root"] / "amdp"))
        assert ours["model"].keys() == theirs["model"].keys()
        assert all(torch.equal(t, theirs["model"][n]) for n, t in ours["model"].items())
        assert ours["optimizer"]["params"].keys() == theirs["optimizer"]["params"].keys()
        for n, entry in ours["optimizer"]["params"].items():
            assert all(torch.equal(t, theirs["optimizer"]["params"][n][k]) for k, t in entry.items()), n


def test_bf16_masters_are_gathered_and_resume_bitwise(megatron_world1, tmp_path: Path) -> None:
    """bf16: the replicas' fp32 master ranges are gathered too (saved in parameter shape) and cut
    back out on load: the resumed run is the straight run's bits."""
    argv = [*tiny_args(4, "amdp", 4, 4, *NO_DROPOUT, "--bf16"), "--num-layers", "4"]
    straight = final_params(emulate([*argv, "--log-json", str(tmp_path / "a.jsonl"), "--save", str(tmp_path / "a"),
                                     "--save-interval", "2"]))
    state = torch.load(ckpt.iteration_dir(tmp_path / "a", 2) / ckpt.rank_file_name(0, 0), weights_only=False)
    assert all(entry["master"].shape == state["model"][name].shape and entry["master"].dtype == torch.float32
               for name, entry in state["optimizer"]["params"].items())
    resumed = final_params(emulate([*argv, "--log-json", str(tmp_path / "b.jsonl"),
                                    "--load", str(_only(tmp_path / "a", 2, tmp_path / "b"))]))
    assert _losses(tmp_path / "b.jsonl") == {it: v for it, v in _losses(tmp_path / "a.jsonl").items() if it > 2}
    assert all(torch.equal(resumed[name], value) for name, value in straight.items())


@pytest.mark.slow
def test_into_the_runtime_at_pp2_dp2_with_the_distributed_optimizer(runs, tmp_path: Path) -> None:
    """AMDP PP4 -> 1F1B PP2 x DP2 through the runtime (4 gloo ranks), the optimizer state sharded
    again over the data-parallel replicas (each cuts its range of the whole state)."""
    argv = _argv(2, "1f1b", tmp_path / "unused.jsonl", "--load", str(runs["amdp3"]), "--data-parallel-size", "2",
                 "--use-distributed-optimizer", "--device", "cpu")
    records, _ = run_pretrain(argv[:argv.index("--log-json")] + argv[argv.index("--log-json") + 2:], tmp_path / "run")
    losses, ref = {r["iteration"]: r["loss"] for r in records}, runs["ref"]
    assert sorted(losses) == [4, 5] and all(_close(losses[it], ref[it]) for it in (4, 5)), (losses, ref)
