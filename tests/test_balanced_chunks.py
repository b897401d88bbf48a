"""The balanced split as the default of chunked layouts (V: zb-v, dualpipev; interleaved-1f1b):
which split the flags give, the banner, explicit per-chunk splits, resuming, and that a run on
the balanced split trains the even split's model (the same model; only the placement changes)
and 1F1B's, in the emulator and the distributed runtime, within the bounds tests/adam_bounds.py
derives from the reference run's own Adam steps."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron.trainer.config.arguments import build_parser
from megatron.trainer.plan.parse import parse_args
from megatron.trainer.plan.build import build_run_plan
from megatron.trainer.tasks.balanced_partition import layer_split_line
from tests.async_helpers import (TINY_GPT, assert_flag_error, assert_trains_like, emulate, emulated_reference,
                                 final_params, read_log, run_pretrain)

ISSUE = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
         "--micro-batch-size", "4", "--vocab-size", "8192", "--pipeline-executor", "emulator",
         "--pipeline-model-parallel-size", "2", "--global-batch-size", "16"]
INTERLEAVED = ["--pipeline-schedule", "interleaved-1f1b", "--num-layers-per-virtual-pipeline-stage", "2"]


def _args(*extra: str):
    return parse_args([*ISSUE, *extra], build_parser("test"))


@pytest.mark.parametrize("schedule", [["--pipeline-schedule", "zb-v"], ["--pipeline-schedule", "dualpipev"],
                                      INTERLEAVED], ids=["zb-v", "dualpipev", "interleaved"])
def test_chunked_layouts_default_to_the_balanced_split(schedule: list[str]) -> None:
    """The issue's model (head = 2.5 layers): the rank holding the head takes 3 layers, 2 in the
    chunk beside it (V: the embedding's, interleaved: its first) and 1 with the head."""
    args = build_run_plan(_args(*schedule))
    assert args.layers.partition == "balanced" and args.layers.counts == [2, 2, 3, 1]
    ranks = "[3, 5]" if "interleaved-1f1b" not in schedule else "[5, 3]"
    owners = "[0, 1, 1, 0]" if "interleaved-1f1b" not in schedule else "[0, 1, 0, 1]"
    assert layer_split_line(args) == (
        f"layer split: [2, 2, 3, 1] per model chunk, {ranks} per rank (rank of each chunk: {owners}) "
        f"(--pipeline-partition balanced)")
    even = build_run_plan(_args(*schedule, "--pipeline-partition", "even")).layers
    assert even.partition == "even" and even.counts is None


def test_explicit_per_chunk_split_and_refusals(capsys) -> None:
    """A V takes one count per chunk (2 PP of them) or per stage (halved); other counts are refused."""
    explicit = build_run_plan(_args("--pipeline-schedule", "zb-v", "--pipeline-layer-split", "1", "3", "3", "1"))
    assert explicit.layers.partition == "explicit" and explicit.layers.counts == [1, 3, 3, 1]
    assert explicit.run.layout.part_layer_split([1, 3, 3, 1]) == [1, 3, 3, 1]
    assert_flag_error(capsys, ["--pipeline-schedule", "1f1b", "--pipeline-layer-split", "1", "1", "1", "1",
                               "--num-layers", "4"], "4 counts for 2 stages")
    assert_flag_error(capsys, ["--pipeline-schedule", "zb-v", "--pipeline-layer-split", "1", "1", "1",
                               "--global-batch-size", "4"], "3 entries for 2 pipeline stages")


# ------------------------------------------------------------------------------ training
def _train_argv(schedule: list[str], *extra: str) -> list[str]:
    """A tiny GPT whose head costs 2.8 layers (vocabulary 512), 8 layers on 2 stages, 4 steps."""
    return [*TINY_GPT, "--vocab-size", "512", "--num-layers", "8", "--pipeline-model-parallel-size", "2",
            "--global-batch-size", "4", "--train-iters", "4", "--log-interval", "1", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--clip-grad", "1.0", "--device", "cpu", *schedule, *extra]


ZBV, DUALPIPEV = ["--pipeline-schedule", "zb-v"], ["--pipeline-schedule", "dualpipev"]


@pytest.fixture(scope="module")
def even_zbv(tmp_path_factory):
    """The reference: zb-v on the even split [2, 2, 2, 2], its Adam steps traced."""
    return emulated_reference(_train_argv(ZBV, "--pipeline-partition", "even"),
                              tmp_path_factory.mktemp("even") / "log.jsonl")


def _chunk_layers(workers) -> list[list[int]]:
    return [[len(chunk.layers) for chunk in w.setup.chunks] for w in workers]


@pytest.mark.usefixtures("megatron_world1")
@pytest.mark.parametrize("schedule, layers", [
    (ZBV, [[2, 1], [2, 3]]), (DUALPIPEV, [[2, 1], [2, 3]]), (["--pipeline-schedule", "1f1b"], [[5], [3]]),
    (["--pipeline-schedule", "interleaved-1f1b", "--num-layers-per-virtual-pipeline-stage", "2"], [[2, 3], [2, 1]])],
    ids=["zb-v", "dualpipev", "1f1b", "interleaved"])
def test_emulator_balanced_trains_like_the_even_split(schedule: list[str], layers: list[list[int]], even_zbv,
                                                      tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    workers = emulate([*_train_argv(schedule), "--pipeline-executor", "emulator", "--log-json", str(log)])
    assert _chunk_layers(workers) == layers  # the placement moved (else this compares a run with itself)
    assert_trains_like(read_log(log), final_params(workers), even_zbv, context=" ".join(schedule))


@pytest.mark.usefixtures("megatron_world1")
@pytest.mark.parametrize("schedule", [ZBV, DUALPIPEV], ids=["zb-v", "dualpipev"])
def test_runtime_balanced_trains_like_the_even_split(schedule: list[str], even_zbv, tmp_path: Path) -> None:
    records, params = run_pretrain(_train_argv(schedule), tmp_path)
    assert "layer split: [2, 2, 3, 1] per model chunk" in (tmp_path / "stdout.txt").read_text()
    assert_trains_like(records, params, even_zbv, context=" ".join(schedule))


def test_zbv_plans_from_per_chunk_costs() -> None:
    """zb-v's placeholder becomes one cost per V chunk in proportion to the chunk's FLOPs on the
    balanced split; the even split and ``--zb-costs`` keep one cost for all."""
    from megatron.pipeline.costs.cost_model import embedding_flops, head_flops, layer_flops
    from megatron.pipeline.costs.op_costs import OpCosts
    from megatron.trainer.tasks.balanced_partition import model_shape

    args = _args("--pipeline-schedule", "zb-v")
    costs = build_run_plan(args).run.schedule.options.costs
    shape = model_shape(build_run_plan(args))
    layer = layer_flops(shape)
    want = [2 * layer + embedding_flops(shape), 2 * layer, 3 * layer, layer + head_flops(shape)]
    assert len(costs) == 4
    assert [c.t_f / costs[0].t_f for c in costs] == pytest.approx([w / want[0] for w in want])
    assert sum(c.t_w for c in costs) == pytest.approx(4.0)  # the placeholder's mean is kept
    even = build_run_plan(_args("--pipeline-schedule", "zb-v", "--pipeline-partition", "even"))
    assert isinstance(even.run.schedule.options.costs, OpCosts)
    given = build_run_plan(_args("--pipeline-schedule", "zb-v", "--zb-costs", "1,2,1,0")).run.schedule.options.costs
    assert len(given) == 2 and given[0].t_b == 2.0


# ------------------------------------------------------------------------------ checkpoints
SAVED = 2


def _losses(log: Path) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in read_log(log) if "loss" in r and "eval_split" not in r}


@pytest.fixture(scope="module")
def saved_zbv(megatron_world1, tmp_path_factory):
    """zb-v on the balanced split, saved at iteration 2 and continued to 4: (checkpoint, losses)."""
    from megatron.trainer.checkpointing import checkpoint as ckpt

    root = tmp_path_factory.mktemp("zbv")
    emulate([*_train_argv(ZBV), "--pipeline-executor", "emulator", "--log-json", str(root / "ref.jsonl"),
             "--save", str(root / "all"), "--save-interval", str(SAVED)])
    meta = json.loads((ckpt.iteration_dir(root / "all", SAVED) / "metadata.json").read_text())
    assert meta["signature"]["pipeline_layer_split"] == [2, 2, 3, 1]  # the checkpoint records the split
    (root / "all" / ckpt.POINTER).write_text(f"{SAVED}\n")
    return root / "all", _losses(root / "ref.jsonl")


@pytest.mark.usefixtures("megatron_world1")
@pytest.mark.parametrize("into", [ZBV, ["--pipeline-schedule", "1f1b"], [*ZBV, "--pipeline-partition", "even"],
                                  DUALPIPEV],
                         ids=["zb-v-kept", "1f1b-chain", "zb-v-even", "dualpipev-same-placement"])
def test_resume_keeps_or_reshards_the_per_chunk_split(saved_zbv, tmp_path: Path, into: list[str], capsys) -> None:
    """Resuming in the same placement keeps the checkpoint's per-chunk split (the default does
    not decide again); another placement or split reshards; every way continues the saved run's
    losses (1e-5 relative: the clip norm's grouping differs between placements)."""
    from tests.async_helpers import _parse
    from megatron.trainer.tasks.gpt import GPTTask

    checkpoint, reference = saved_zbv
    argv = [*_train_argv(into), "--load", str(checkpoint), "--pipeline-executor", "emulator"]
    config = _parse(argv, GPTTask())
    same = "even" not in into and "1f1b" not in into
    if same:
        assert config.layers.partition == "checkpoint" and config.layers.counts == [2, 2, 3, 1]
    capsys.readouterr()
    emulate([*argv, "--log-json", str(tmp_path / "log.jsonl")])
    out = capsys.readouterr().out
    assert ("stage partition changed" in out) != same, out[-2000:]
    losses = _losses(tmp_path / "log.jsonl")
    assert sorted(losses) == [3, 4]
    assert all(abs(losses[i] - reference[i]) <= 1e-5 * abs(reference[i]) for i in losses), (losses, reference)


# ------------------------------------------------------------------------------ planner
@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev", "interleaved-1f1b"])
def test_planner_prices_chunked_candidates_with_the_trainers_split(schedule: str) -> None:
    """The planner offers chunked layouts on the balanced split (and the even one), and the flags
    it prints for each make the trainer build exactly the counts it priced."""
    from megatron.pipeline.planner.candidates import enumerate_candidates
    from megatron.pipeline.planner.report import flags
    from megatron.trainer.tasks.balanced_partition import model_shape

    shape = model_shape(build_run_plan(_args()))
    found = {c.layer_split: c for c, _ in enumerate_candidates(shape, [2], 16, 1, schedules=[schedule], recomputes=["none"])
             if c is not None and c.micro_batch_size == 4 and c.virtual_stages in (1, 2)}
    assert set(found) == {"balanced", "even"}
    assert found["balanced"].counts == (2, 2, 3, 1) and found["even"].counts == (2, 2, 2, 2)
    for split, cand in found.items():
        parsed = build_run_plan(_args(*flags(cand, 8)))
        assert parsed.layers.counts == (None if split == "even" else list(cand.counts)), (split, flags(cand, 8))


# ------------------------------------------------------------------------------ profiled
@pytest.mark.usefixtures("megatron_world1")
@pytest.mark.parametrize("schedule", [ZBV, ["--pipeline-schedule", "interleaved-1f1b",
                                             "--num-layers-per-virtual-pipeline-stage", "2"]], ids=["zb-v", "interleaved"])
def test_profiled_partition_splits_per_chunk(schedule: list[str], capsys) -> None:
    """``--pipeline-partition profiled`` on a chunked layout: the profile's layer, embedding and
    head go through the same per-rank solver; every chunk gets its own count, and the run builds them."""
    argv = [*_train_argv(schedule), "--train-iters", "1", "--pipeline-executor", "emulator",
            "--pipeline-partition", "profiled", "--pipeline-partition-profile-iters", "1"]
    capsys.readouterr()
    workers = emulate(argv)
    line = next(l for l in capsys.readouterr().out.splitlines() if "pipeline partition profiled: layer split" in l)
    counts = [int(c) for c in line.split("layer split [", 1)[1].split("]", 1)[0].split(",")]
    assert len(counts) == 4 and sum(counts) == 8 and min(counts) >= 1 and "per chunk" in line
    built = sorted(n for chunks in _chunk_layers(workers) for n in chunks)
    assert built == sorted(counts), (built, counts)
