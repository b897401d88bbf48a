"""Tied input embedding and output layer (Megatron-LM's default) across pipeline stages.

The reference is the one-stage tied model (one parameter, autograd sums its two uses). A split
model keeps a copy on the output layer's stage and sums the two gradients before each step
(megatron/pipeline/runtime/tied_embeddings.py): the gradient is the same sum in another order
(per micro-batch vs per copy), so parameters agree within the per-element bounds derived from
the reference's own AdamW steps (tests/adam_bounds.py) and losses within its ``rho``; the two
copies are bitwise equal after every step, since both receive the same bits and step alike.

On the V layout (zb-v, v-half, v-min, dualpipev) stage 0 holds both ends, in its two chunks: they
share one parameter there (no copy), whose gradient autograd accumulates from both chunks as at
PP = 1; the other stages hold no end. The comparison with PP = 1 is the same.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from async_helpers import (
    TINY_GPT, assert_trains_like, emulate, emulated_reference, final_params, read_log, run_pretrain)

TIED_GPT = [flag for flag in TINY_GPT if flag != "--untie-embeddings-and-output-weights"]  # the default, tied
from megatron.pipeline.runtime.executors.core import OpCore
from megatron.pipeline.runtime.tied_embeddings import is_tied_copy, tied_parameters
from megatron.trainer.checkpointing.format import run_signature
from megatron.trainer.config.run_plan import RunPlan

FP32_NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
TIED = "embedding.word_embeddings.weight"


def _argv(pp: int, schedule: str, layers: int = 4, batch: int = 4, iters: int = 3) -> list[str]:
    return [*TIED_GPT, *FP32_NO_DROPOUT, "--num-layers", str(layers), "--pipeline-model-parallel-size", str(pp),
            "--pipeline-schedule", schedule, "--global-batch-size", str(batch), "--train-iters", str(iters),
            "--log-interval", "1"]


def _v_argv(pp: int, schedule: str, *more: str) -> list[str]:
    """8 layers (a V at PP = 4 has 8 virtual stages of one layer each), 8 micro-batches
    (dualpipev needs 2 per stage)."""
    return [*_argv(pp, schedule, layers=8, batch=8), *more]


@pytest.fixture
def copies_checked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """After every step of the emulator: all tied ends hold the same bits; returns the step count."""
    steps: list[int] = []
    step = OpCore.step

    def checked(self: OpCore, ops) -> None:
        step(self, ops)
        ends = [p for w in self.workers for p in tied_parameters(w.setup.chunks)]
        assert all(torch.equal(ends[0], p) for p in ends[1:]), f"copies differ after update {ops[0].update}"
        steps.append(len(ends))

    monkeypatch.setattr(OpCore, "step", checked)
    return steps


@pytest.mark.parametrize("schedule", ["1f1b", "zb-2p"])
def test_split_tied_runs_train_like_one_stage(megatron_world1, tmp_path: Path, copies_checked, schedule) -> None:
    ref = emulated_reference(_argv(1, "1f1b"), tmp_path / "ref.jsonl")
    assert TIED in ref.params and "output_layer.weight" not in ref.params  # one parameter at PP = 1
    for pp in (2, 4):
        copies_checked.clear()
        log = tmp_path / f"{schedule}{pp}.jsonl"
        workers = emulate([*_argv(pp, schedule), "--pipeline-executor", "emulator", "--log-json", str(log)])
        assert copies_checked and set(copies_checked) == {2}, copies_checked  # both ends, every step
        copy = [p for p in workers[-1].setup.chunks[0].parameters() if is_tied_copy(p)]
        assert len(copy) == 1 and torch.equal(copy[0], workers[0].setup.chunks[0].model.embedding.word_embeddings.weight)
        assert_trains_like(read_log(log), final_params(workers), ref, context=f"{schedule} PP={pp}")


def _shares_one_parameter(worker) -> bool:
    """Stage 0 of a V: the last chunk's output layer reads the first chunk's embedding."""
    first, last = worker.setup.chunks
    return last.model.output_layer.weight is first.model.embedding.word_embeddings.weight


@pytest.mark.parametrize("schedule, stages", [("zb-v", (2, 4)), ("dualpipev", (2, 4)), ("v-half", (2,)), ("v-min", (2,))])
def test_v_tied_runs_train_like_one_stage(megatron_world1, tmp_path: Path, copies_checked, schedule, stages) -> None:
    ref = emulated_reference(_v_argv(1, "1f1b"), tmp_path / "ref.jsonl")
    for pp in stages:
        copies_checked.clear()
        log = tmp_path / f"{schedule}{pp}.jsonl"
        workers = emulate([*_v_argv(pp, schedule), "--pipeline-executor", "emulator", "--log-json", str(log)])
        assert copies_checked and set(copies_checked) == {1}, copies_checked  # one end, one parameter
        assert _shares_one_parameter(workers[0])
        assert not any(is_tied_copy(p) for w in workers for c in w.setup.chunks for p in c.parameters())
        assert not any(tied_parameters(w.setup.chunks) for w in workers[1:])
        assert_trains_like(read_log(log), final_params(workers), ref, context=f"{schedule} PP={pp}")


def test_v_layout_ties_under_post_validation(megatron_world1) -> None:
    """Post-validation's optimistic step needs no sum on a V (stage 0 holds the one tied
    parameter): with --clip-grad 0.5 rolling back and redoing steps, tied zb-v ends bitwise
    where the plain synchronous step does."""
    argv = [*_v_argv(2, "zb-v", "--clip-grad", "0.5"), "--pipeline-executor", "emulator"]
    validated = emulate([*argv, "--enable-optimizer-post-validation"])
    assert _shares_one_parameter(validated[0])
    plain, ours = final_params(emulate(argv)), final_params(validated)
    assert plain.keys() == ours.keys() and all(torch.equal(ours[n], plain[n]) for n in plain)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_distributed_runtime_keeps_the_copies_equal_to_the_emulator(megatron_world1, tmp_path: Path, schedule) -> None:
    """Two ranks sum over their embedding group (1f1b), or rank 0 holds the one shared
    parameter (zb-v): the same bits as the emulator."""
    argv = [*_argv(2, schedule), "--num-threads", "1"]
    records, dist_params = run_pretrain(argv, tmp_path / "dist")
    emu = final_params(emulate([*argv, "--pipeline-executor", "emulator"]))
    assert dist_params.keys() == emu.keys()
    for name in emu:
        assert torch.equal(dist_params[name], emu[name]), name
    stages = [torch.load(f) for f in sorted((tmp_path / "dist" / "params").glob("stage*.pt"))]
    if schedule == "zb-v":  # the V's stage 0 holds both ends, stage 1 none
        assert TIED in stages[0] and not any(n in stages[1] for n in (TIED, "output_layer.weight"))
    else:
        assert torch.equal(stages[0][TIED], stages[-1][TIED])  # each rank dumped its own end


def test_a_tied_v_checkpoint_resumes_and_reshards_into_a_chain(megatron_world1, tmp_path: Path) -> None:
    """zb-v saves one tied parameter; its checkpoint records the tied model, resumes bitwise
    and loads into 1F1B at PP = 2: both ends start from the saved parameter, so the first loss
    after loading (a forward of the same weights, micro-batch by micro-batch) is the saving
    run's, and the two ends stay bitwise equal."""
    from megatron.trainer.checkpointing import checkpoint as ckpt

    def run(schedule: str, log: str, *more: str):
        workers = emulate([*_argv(2, schedule, iters=4), "--pipeline-executor", "emulator",
                           "--log-json", str(tmp_path / log), *more])
        return workers, {r["iteration"]: r["loss"] for r in read_log(tmp_path / log) if "loss" in r}

    workers, straight = run("zb-v", "v.jsonl", "--save", str(tmp_path / "v"), "--save-interval", "2")
    (tmp_path / "v" / ckpt.POINTER).write_text("2\n")
    metadata = json.loads((ckpt.iteration_dir(tmp_path / "v", 2) / "metadata.json").read_text())
    assert metadata["signature"]["untie_embeddings_and_output_weights"] is False
    resumed, losses = run("zb-v", "resumed.jsonl", "--load", str(tmp_path / "v"))
    assert losses == {i: straight[i] for i in (3, 4)}
    resumed_params, straight_params = final_params(resumed), final_params(workers)
    assert resumed_params.keys() == straight_params.keys()
    assert all(torch.equal(resumed_params[n], straight_params[n]) for n in straight_params)
    chain, losses = run("1f1b", "chain.jsonl", "--load", str(tmp_path / "v"))
    assert losses[3] == straight[3], (losses, straight)
    ends = [p for w in chain for p in tied_parameters(w.setup.chunks)]
    assert len(ends) == 2 and torch.equal(ends[0], ends[1])


def _stage_counts(argv: list[str], task) -> tuple[RunPlan, list[int]]:
    """The flags' run plan and the banner's parameters per stage (tied copies counted once)."""
    from megatron.pipeline.runtime.tied_embeddings import counted
    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_run_plan

    parser = build_parser()
    task.add_arguments(parser)
    config = parse_run_plan(argv, parser)
    counts = [sum(p.numel() for p in counted(p for chunk in task.build_stage(config, s, torch.device("cpu"))
                                             for p in chunk.parameters()))
              for s in range(config.parallel.pipeline_model_parallel_size)]
    return config, counts


def test_megatron_gpt3_flag_set_builds_a_tied_model(megatron_world1, tmp_path: Path) -> None:
    """Megatron-LM's GPT-3 175B flags (shrunk, tests/test_megatron_examples.py) build a tied
    model: the banner counts GPT's closed form with the vocabulary matrix once,
    V h + P h + L (12 h^2 + 13 h) + 2 h (per layer: QKV 3h^2 + 3h, projection h^2 + h, MLP
    8h^2 + 5h, two norms 4h; the final norm 2h); untied adds exactly V h."""
    from megatron.trainer.loop.run_banner import banner_lines
    from megatron.trainer.tasks.gpt import GPTTask
    from tests.test_megatron_examples import GPT_175B, shrink

    argv = shrink(GPT_175B, tmp_path)
    config, counts = _stage_counts(argv, GPTTask())
    model = config.model
    h, layers, vocab, positions = model.hidden_size, model.num_layers, config.vocab.size, model.max_position_embeddings
    closed_form = vocab * h + positions * h + layers * (12 * h * h + 13 * h) + 2 * h
    assert config.embeddings.tied and sum(counts) == closed_form
    lines = banner_lines(config, counts, "emulator")
    assert f"total: {closed_form:,}" in "\n".join(lines) and "embeddings: tied" in "\n".join(lines)
    _, untied = _stage_counts([*argv, "--untie-embeddings-and-output-weights"], GPTTask())
    assert sum(untied) - sum(counts) == vocab * h


@pytest.mark.parametrize("pp", [2, 4])
def test_v_layout_banner_counts_the_tied_model(megatron_world1, pp: int) -> None:
    """A V's stage 0 counts the shared parameter once: the PP = 1 tied total, V h less than untied."""
    from megatron.trainer.tasks.gpt import GPTTask

    _, one = _stage_counts(_v_argv(1, "1f1b"), GPTTask())
    config, counts = _stage_counts(_v_argv(pp, "zb-v"), GPTTask())
    _, untied = _stage_counts([*_v_argv(pp, "zb-v"), "--untie-embeddings-and-output-weights"], GPTTask())
    model = config.model
    assert config.embeddings.tied and config.embeddings.line.startswith("embeddings: tied")
    assert sum(counts) == sum(one) and sum(untied) - sum(counts) == config.vocab.size * model.hidden_size


@pytest.mark.parametrize("schedule, flags", [
    ("1f1b", ("--use-distributed-optimizer",)), ("zb-v", ("--use-distributed-optimizer",)),
    ("zb-v", ("--overlap-grad-reduce",)), ("zb-v", ("--overlap-grad-reduce", "--use-distributed-optimizer"))])
def test_data_parallel_options_tie_at_pp2(megatron_world1, schedule: str, flags: tuple[str, ...]) -> None:
    from megatron.trainer.tasks.gpt import GPTTask

    config, _ = _stage_counts([*_argv(2, schedule), *flags], GPTTask())
    assert config.embeddings.tied, config.embeddings.line


def _dp2(schedule: str, *more: str) -> list[str]:
    """PP 2 x DP 2 on gloo: 8 samples, 2 micro-batches per replica and update (the reference:
    one stage, one replica, the same 8 samples per update)."""
    return [*_argv(2, schedule, batch=8), "--data-parallel-size", "2", *more]


def _assert_dp2_tied_like_reference(tmp_path: Path, schedule: str, *flags: str) -> None:
    from async_helpers import _parse
    from megatron.trainer.tasks.gpt import GPTTask

    ref = emulated_reference(_argv(1, "1f1b", batch=8), tmp_path / "ref.jsonl")
    records, params = run_pretrain(_dp2(schedule, *flags), tmp_path / "dist")
    stages = [torch.load(f) for f in sorted((tmp_path / "dist" / "params").glob("stage*.pt"))]
    if schedule == "zb-v":  # the V's stage 0 holds the one shared parameter
        assert TIED in stages[0] and not any(n in stages[1] for n in (TIED, "output_layer.weight"))
    else:  # each stage's rank dumped its own end: the copies stayed bitwise equal
        assert torch.equal(stages[0][TIED], stages[-1][TIED])
    stdout = (tmp_path / "dist" / "stdout.txt").read_text()
    plan = _parse(_dp2(schedule, *flags), GPTTask())
    tied = plan.vocab.size * plan.model.hidden_size  # the tied parameter count, in the banner and the log
    assert "embeddings: tied" in stdout and f"tied parameters: {tied:,}" in stdout
    assert all(r["embeddings"]["tied"] and r["embeddings"]["tied_parameters"] == tied for r in records)
    assert_trains_like(records, params, ref, context=f"{schedule} PP2 DP2 {' '.join(flags)}")


@pytest.mark.slow
@pytest.mark.parametrize("schedule, flags", [
    ("1f1b", ()), ("zb-v", ()), ("1f1b", ("--overlap-grad-reduce",))], ids=["1f1b", "zb-v", "1f1b-overlap"])
def test_distributed_optimizer_at_pp2_dp2_ties_and_trains_like_one_stage(megatron_world1, tmp_path: Path,
                                                                        schedule: str, flags: tuple[str, ...]) -> None:
    """The embedding group sums the whole gradients before the data-parallel reduce-scatter; each
    replica steps its own range of them: the two ends stay bitwise equal (1f1b) and the run
    trains like the tied one-stage reference. With overlapped buckets (all-reduces of every
    gradient) the sum comes after them, as without the distributed optimizer."""
    _assert_dp2_tied_like_reference(tmp_path, schedule, "--use-distributed-optimizer", *flags)


def test_asynchronous_schedules_stay_untied_and_say_why(megatron_world1) -> None:
    from megatron.trainer.tasks.gpt import GPTTask

    config, counts = _stage_counts([*_argv(2, "paci")], GPTTask())
    assert not config.embeddings.tied and run_signature(GPTTask(), config)["untie_embeddings_and_output_weights"]
    assert "untied, as every asynchronous schedule (paci): each stage steps on its own clock" in config.embeddings.line


def test_bert_ties_across_stages(megatron_world1, tmp_path: Path) -> None:
    """BERT's output layer copy on the last stage starts equal to the embedding and stays equal."""
    from megatron.trainer.tasks.bert import BertTask

    workers = emulate([*_argv(2, "1f1b"), "--pipeline-executor", "emulator"], BertTask())
    ends = [p for w in workers for p in tied_parameters(w.setup.chunks)]
    assert len(ends) == 2 and torch.equal(ends[0], ends[1]) and workers[0].setup.optimizer.step_count == 3


def test_v_layout_ties_at_tp2_like_tp1(megatron_world1, tmp_path: Path) -> None:
    """zb-v at TP = 2 (4 ranks): stage 0's chunks share the vocabulary-parallel shard of the
    tied weight (the embedding's and the output layer's shards split the vocabulary alike) and
    train like the TP = 1 tied emulator run, within the derived bounds."""
    from tests.test_tensor_parallel_runtime import MODEL, _launch_tp2

    tied = [flag for flag in MODEL if flag != "--untie-embeddings-and-output-weights"]
    flags = ["--num-layers", "4", "--zb-costs", "1,1,1,0"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("tests.test_tensor_parallel_runtime.MODEL", tied)
        (result,) = _launch_tp2([("zb-v", flags)], tmp_path)
        ref = emulated_reference([*tied, "--pipeline-schedule", "zb-v", *flags], tmp_path / "tp1.jsonl")
    assert TIED in ref.params and "output_layer.weight" not in ref.params
    assert_trains_like(*result, ref, context="zb-v TP=2 tied: ")


@pytest.mark.slow
@pytest.mark.parametrize("flags", [("--overlap-grad-reduce",), ("--overlap-grad-reduce", "--use-distributed-optimizer")],
                         ids=["overlap", "overlap-distributed-optimizer"])
def test_v_layout_overlapped_reduction_at_pp2_dp2_ties_and_trains_like_one_stage(
        megatron_world1, tmp_path: Path, flags: tuple[str, ...]) -> None:
    """zb-v: the shared parameter's bucket launches once both chunks of stage 0 accumulated
    into it (a bucket launched after the first would average half the gradient)."""
    _assert_dp2_tied_like_reference(tmp_path, "zb-v", *flags)


def test_banner_json_log_and_planner_say_tied_or_why_not(megatron_world1, tmp_path: Path) -> None:
    """The tied parameter count is in the banner and every --log-json record; an asynchronous
    schedule's reason for staying untied is in both and in the planner's candidate records."""
    from megatron.pipeline.planner.evaluate import tied_embeddings
    from megatron.trainer.loop.run_banner import banner_lines
    from megatron.trainer.tasks.gpt import GPTTask

    config, counts = _stage_counts(_argv(2, "1f1b"), GPTTask())
    tied = config.vocab.size * config.model.hidden_size
    assert f"tied parameters: {tied:,}" in "\n".join(banner_lines(config, counts, "emulator"))
    records = {}
    for schedule in ("1f1b", "paci"):
        log = tmp_path / f"{schedule}.jsonl"
        emulate([*_argv(2, schedule, iters=1), "--pipeline-executor", "emulator", "--log-json", str(log)])
        records[schedule] = [r["embeddings"] for r in read_log(log)]
    assert records["1f1b"] and all(r["tied"] and r["tied_parameters"] == tied for r in records["1f1b"])
    (paci,) = set(json.dumps(r) for r in records["paci"])
    paci = json.loads(paci)
    assert not paci["tied"] and paci["tied_parameters"] == 0 and "each stage steps on its own clock" in paci["line"]
    assert tied_embeddings("1f1b") == tied_embeddings("zb-v") == "tied"
    assert tied_embeddings("paci").startswith("untied: each stage steps on its own clock")


def _gpt_closed_form(argv: list[str], vocab: int) -> int:
    """GPT's parameter count from the flags alone, the vocabulary matrix once (tied): V h + P h
    (learned positions) + L (12 h^2 + 13 h) + 2 h. Per layer: QKV 3h^2 + 3h, projection h^2 + h,
    MLP (ffn 4h) 8h^2 + 5h, two LayerNorms 4h; the final LayerNorm 2h; no output layer."""
    def flag(name: str) -> int:
        return int(argv[len(argv) - 1 - argv[::-1].index(name) + 1])  # the last occurrence wins

    h, layers, positions = flag("--hidden-size"), flag("--num-layers"), flag("--max-position-embeddings")
    assert "--ffn-hidden-size" not in argv and "--disable-bias-linear" not in argv
    assert "--normalization" not in argv and "--position-embedding-type" not in argv  # LayerNorm, learned
    return vocab * h + positions * h + layers * (12 * h * h + 13 * h) + 2 * h


def _gpt3_175b_distributed_optimizer(tmp_path: Path, *more: str) -> list[str]:
    """Megatron-LM's GPT-3 175B flags (shrunk), with --use-distributed-optimizer at PP = 2."""
    from tests.test_megatron_examples import GPT_175B, shrink

    argv = shrink(GPT_175B, tmp_path)
    assert argv[argv.index("--pipeline-model-parallel-size") + 1] == "2"
    return [*argv, "--use-distributed-optimizer", *more]


def test_megatron_gpt3_flag_set_with_distributed_optimizer_builds_the_tied_closed_form(
        megatron_world1, tmp_path: Path, capsys) -> None:
    """GPT-3 175B's flags with --use-distributed-optimizer at PP = 2 tie: the run's banner (emulator,
    one replica) and the stages built for PP 2 x DP 2 count the closed form."""
    from megatron.trainer.tasks.gpt import GPTTask

    argv = _gpt3_175b_distributed_optimizer(tmp_path, "--train-iters", "1")
    config, counts = _stage_counts([*argv, "--pipeline-executor", "distributed", "--data-parallel-size", "2"],
                                   GPTTask())
    vocab = config.vocab.size
    closed_form = _gpt_closed_form(argv, vocab)
    assert config.embeddings.tied and config.parallel.use_distributed_optimizer
    assert sum(counts) == closed_form, (counts, closed_form)
    emulate(argv)
    stdout = capsys.readouterr().out
    assert f"total: {closed_form:,}" in stdout and f"tied parameters: {vocab * 64:,}" in stdout, stdout[-2000:]


@pytest.mark.slow
def test_megatron_gpt3_flag_set_with_distributed_optimizer_at_pp2_dp2_runs_the_tied_closed_form(
        megatron_world1, tmp_path: Path) -> None:
    """The same flags on 4 ranks (PP 2 x DP 2, gloo): the banner's total is the closed form."""
    from async_helpers import _parse
    from megatron.trainer.tasks.gpt import GPTTask

    argv = _gpt3_175b_distributed_optimizer(tmp_path, "--train-iters", "2",
                                           "--pipeline-executor", "distributed", "--data-parallel-size", "2")
    vocab = _parse(argv, GPTTask()).vocab.size
    closed_form = _gpt_closed_form(argv, vocab)
    records, _ = run_pretrain(argv, tmp_path / "dist")
    stdout = (tmp_path / "dist" / "stdout.txt").read_text()
    assert f"total: {closed_form:,}" in stdout and "embeddings: tied" in stdout, stdout[-2000:]
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(r["embeddings"]["tied"] and r["embeddings"]["tied_parameters"] == vocab * 64 for r in records)
