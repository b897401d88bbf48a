"""Tied input embedding and output layer (Megatron-LM's default) across pipeline stages.

The reference is the one-stage tied model (one parameter, autograd sums its two uses). A split
model keeps a copy on the output layer's stage and sums the two gradients before each step
(megatron/pipeline/runtime/tied_embeddings.py): the gradient is the same sum in another order
(per micro-batch vs per copy), so parameters agree within the per-element bounds derived from
the reference's own AdamW steps (tests/adam_bounds.py) and losses within its ``rho``; the two
copies are bitwise equal after every step, since both receive the same bits and step alike.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from async_helpers import (
    TINY_GPT, assert_trains_like, emulate, emulated_reference, final_params, read_log, run_pretrain)

TIED_GPT = [flag for flag in TINY_GPT if flag != "--untie-embeddings-and-output-weights"]  # the default, tied
from megatron.pipeline.runtime.executors.core import OpCore
from megatron.pipeline.runtime.tied_embeddings import is_tied_copy, tied_parameters

FP32_NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
TIED = "embedding.word_embeddings.weight"


def _argv(pp: int, schedule: str) -> list[str]:
    return [*TIED_GPT, *FP32_NO_DROPOUT, "--num-layers", "4", "--pipeline-model-parallel-size", str(pp),
            "--pipeline-schedule", schedule, "--global-batch-size", "4", "--train-iters", "3", "--log-interval", "1"]


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


def test_distributed_runtime_keeps_the_copies_equal_to_the_emulator(megatron_world1, tmp_path: Path) -> None:
    """Two ranks sum over their embedding group: the same bits as the emulator's local sum."""
    argv = [*_argv(2, "1f1b"), "--num-threads", "1"]
    records, dist_params = run_pretrain(argv, tmp_path / "dist")
    emu = final_params(emulate([*argv, "--pipeline-executor", "emulator"]))
    assert dist_params.keys() == emu.keys()
    for name in emu:
        assert torch.equal(dist_params[name], emu[name]), name
    stages = [torch.load(f) for f in sorted((tmp_path / "dist" / "params").glob("stage*.pt"))]
    assert torch.equal(stages[0][TIED], stages[-1][TIED])  # each rank dumped its own end


def _stage_counts(argv: list[str], task) -> tuple[object, list[int]]:
    """The flags' args and the banner's parameters per stage (tied copies counted once)."""
    from megatron.pipeline.runtime.tied_embeddings import counted
    from megatron.trainer.config.arguments import build_parser, parse_args

    parser = build_parser()
    task.add_arguments(parser)
    args = parse_args(argv, parser)
    counts = [sum(p.numel() for chunk in task.build_stage(args, s, torch.device("cpu")) for p in counted(chunk.parameters()))
              for s in range(args.pipeline_model_parallel_size)]
    return args, counts


def test_megatron_gpt3_flag_set_builds_a_tied_model(megatron_world1, tmp_path: Path) -> None:
    """Megatron-LM's GPT-3 175B flags (shrunk, tests/test_megatron_examples.py) build a tied
    model: the banner counts GPT's closed form with the vocabulary matrix once,
    V h + P h + L (12 h^2 + 13 h) + 2 h (per layer: QKV 3h^2 + 3h, projection h^2 + h, MLP
    8h^2 + 5h, two norms 4h; the final norm 2h); untied adds exactly V h."""
    from megatron.trainer.loop.run_banner import banner_lines
    from megatron.trainer.tasks.gpt import GPTTask
    from tests.test_megatron_examples import GPT_175B, shrink

    argv = shrink(GPT_175B, tmp_path)
    args, counts = _stage_counts(argv, GPTTask())
    h, layers, vocab, positions = args.hidden_size, args.num_layers, args.vocab_size, args.max_position_embeddings
    closed_form = vocab * h + positions * h + layers * (12 * h * h + 13 * h) + 2 * h
    assert args.tie_embeddings and sum(counts) == closed_form
    lines = banner_lines(args, counts, "emulator")
    assert f"total: {closed_form:,}" in "\n".join(lines) and "embeddings: tied" in "\n".join(lines)
    _, untied = _stage_counts([*argv, "--untie-embeddings-and-output-weights"], GPTTask())
    assert sum(untied) - sum(counts) == vocab * h


def test_asynchronous_schedules_stay_untied_and_say_why(megatron_world1) -> None:
    from megatron.trainer.tasks.gpt import GPTTask

    args, counts = _stage_counts([*_argv(2, "paci")], GPTTask())
    assert not args.tie_embeddings and args.untie_embeddings_and_output_weights
    assert "untied, as every asynchronous schedule (paci): each stage steps on its own clock" in args.embeddings_line


def test_bert_ties_across_stages(megatron_world1, tmp_path: Path) -> None:
    """BERT's output layer copy on the last stage starts equal to the embedding and stays equal."""
    from megatron.trainer.tasks.bert import BertTask

    workers = emulate([*_argv(2, "1f1b"), "--pipeline-executor", "emulator"], BertTask())
    ends = [p for w in workers for p in tied_parameters(w.setup.chunks)]
    assert len(ends) == 2 and torch.equal(ends[0], ends[1]) and workers[0].setup.optimizer.step_count == 3
