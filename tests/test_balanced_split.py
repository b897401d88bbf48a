"""The balanced layer split (``--pipeline-partition balanced``, the default): the analytic cost
model against torch's own FLOP counter on megatron-core stages, the split it picks and when it
applies, and that a run on the balanced split computes what a run on the even split does."""
from __future__ import annotations

import argparse

import pytest
import torch

from megatron.pipeline.costs.cost_model import head_flops, layer_flops
from megatron.trainer.config.arguments import build_parser
from megatron.trainer.plan.parse import parse_args, parse_run_plan
from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.plan.build import build_run_plan
from megatron.trainer.tasks.balanced_partition import layer_split_line, model_shape
from megatron.trainer.tasks.gpt import GPTTask
from tests.adam_bounds import assert_within_bounds, gpt_gradient_noise, trace_adam

TINY = ["--pipeline-executor", "emulator", "--device", "cpu", "--num-threads", "1", "--seq-length", "8",
        "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1", "--log-interval", "1"]
ISSUE = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
         "--micro-batch-size", "4", "--vocab-size", "8192", "--pipeline-executor", "emulator"]


def _args(flags: list[str], bert: bool = False) -> argparse.Namespace:
    parser = build_parser("test")
    if bert:
        from megatron.trainer.tasks.bert import BertTask

        BertTask().add_arguments(parser)
    return parse_args(flags, parser)


def _config(flags: list[str], bert: bool = False) -> RunPlan:
    """The run plan of :func:`_args`' namespace (what the functions below the flags read)."""
    return build_run_plan(_args(flags, bert))


def _counted_flops(config: RunPlan, last: bool) -> float:
    """torch's FlopCounterMode over one forward + backward of a one-layer stage (with the head
    and loss when ``last``), built exactly as the trainer builds stages."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron.trainer.models.gpt import build_gpt_stage
    from megatron.trainer.tasks.gpt import gpt_model_args

    task, device = GPTTask(), torch.device("cpu")
    chunk = build_gpt_stage(gpt_model_args(config), range(0, 1), pre_process=False, post_process=last, seed=1,
                            device=device)
    batch = task.batch_fn(config, 0, device)(0)
    shape, _ = task.activation_spec(config)
    x = torch.randn(shape, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        out = chunk(x, batch)
        if last:
            task.loss_fn(out, batch)[0].backward()
        else:
            out.backward(torch.ones_like(out))
    return float(counter.get_total_flops())


@pytest.mark.usefixtures("megatron_world1")
@pytest.mark.parametrize("extra", [[], ["--num-query-groups", "2", "--ffn-hidden-size", "48"], ["--swiglu"]],
                         ids=["mha", "gqa-ffn", "swiglu"])
def test_layer_and_head_flops_match_torchs_flop_counter(extra: list[str]) -> None:
    """The model's matmul FLOPs equal what torch counts on the megatron-core layer; the head's
    differ only by the loss's element-wise work, which torch does not count."""
    config = _config([*TINY, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                      "--vocab-size", "128", "--micro-batch-size", "2", *extra])
    shape = model_shape(config)
    layer = _counted_flops(config, last=False)
    assert layer_flops(shape) == pytest.approx(layer, rel=1e-6)
    head = _counted_flops(config, last=True) - layer
    loss_elementwise = head_flops(shape) - 6 * shape.seq_length * shape.micro_batch * shape.hidden * shape.vocab
    assert head_flops(shape) - loss_elementwise == pytest.approx(head, rel=1e-6)


def test_issue_workload_moves_layers_off_the_head_stage() -> None:
    """The issue's GPT (head = 2.5 layers of FLOPs): [5, 3] on 2 stages, [2, 2, 3, 1] on 4."""
    two = _config([*ISSUE, "--pipeline-model-parallel-size", "2"])
    assert two.layers.partition == "balanced" and two.layers.counts == [5, 3]
    assert layer_split_line(two) == "layer split: [5, 3] (--pipeline-partition balanced)"
    four = _config([*ISSUE, "--pipeline-model-parallel-size", "4"])
    assert four.layers.counts == [2, 2, 3, 1]
    again = _config([*ISSUE, "--pipeline-model-parallel-size", "4"])
    assert again.layers.counts == four.layers.counts  # from the flags alone


def test_small_head_keeps_the_even_split_and_its_signature() -> None:
    """A head cheaper than a layer leaves the even split, recorded as ``None`` like before."""
    args = _config([*TINY, "--pipeline-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "64",
                  "--num-attention-heads", "4", "--vocab-size", "256"])
    assert args.layers.partition == "balanced" and args.layers.counts is None
    assert layer_split_line(args) == "layer split: [2, 2] (--pipeline-partition balanced)"


def test_bert_heads_are_costed() -> None:
    """BERT's LM-head transform and pooler add to the last stage's cost."""
    flags = [*ISSUE, "--pipeline-model-parallel-size", "2"]
    bert = model_shape(_config(flags, bert=True))
    gpt = model_shape(_config(flags))
    assert bert.bert and bert.binary_head and head_flops(bert) > head_flops(gpt)


def test_where_balanced_does_not_apply() -> None:
    """AMDP's replicated pipelines and full recompute keep the even split by default and refuse an
    explicit ``balanced`` (chunked layouts balance: tests/test_balanced_chunks.py); an explicit
    split is the user's; ``even`` stays available."""
    replicated = [*ISSUE, "--pipeline-model-parallel-size", "4", "--pipeline-schedule", "amdp",
                  "--global-batch-size", "16"]
    assert _config(replicated).layers.partition == "even"
    assert _config(replicated).layers.counts is None
    with pytest.raises(SystemExit):
        _args([*replicated, "--pipeline-partition", "balanced"])
    recompute = [*ISSUE, "--pipeline-model-parallel-size", "2", "--recompute-granularity", "full",
                 "--recompute-method", "uniform", "--recompute-num-layers", "2"]
    assert _config(recompute).layers.counts is None
    explicit = _config([*ISSUE, "--pipeline-model-parallel-size", "2", "--pipeline-layer-split", "6", "2"])
    assert explicit.layers.counts == [6, 2]
    assert layer_split_line(explicit) == "layer split: [6, 2] (--pipeline-layer-split)"
    even = _config([*ISSUE, "--pipeline-model-parallel-size", "2", "--pipeline-partition", "even"])
    assert even.layers.counts is None
    alias = _config([*ISSUE, "--pipeline-model-parallel-size", "2", "--pipeline-partition", "auto"])
    assert alias.layers.partition == "profiled"


def test_memory_budget_moves_layers() -> None:
    """Under 1F1B stage 0 holds N activations per layer; a budget that only fits it with fewer
    layers (0.17 GB: the model counts 194 MB for [5, 3], 162 for [4, 4]) gives the even split."""
    free = _config([*ISSUE, "--pipeline-model-parallel-size", "2", "--global-batch-size", "32"])
    tight = _config([*ISSUE, "--pipeline-model-parallel-size", "2", "--global-batch-size", "32",
                   "--pipeline-partition-memory-gb", "0.17"])
    assert free.layers.counts == [5, 3]
    assert tight.layers.counts is None and tight.layers.feasible


@pytest.mark.usefixtures("megatron_world1")
def test_balanced_split_trains_like_the_even_split() -> None:
    """A split moves layers, not arithmetic: after one update the balanced [3, 1] run's
    parameters equal the even [2, 2] run's (same flags otherwise, emulator), up to the gradient
    norm's per-stage sum: each element within the bound tests/adam_bounds.py derives from the even
    run's Adam step (4 layers, hidden 16, FFN 64, vocabulary 256, 8 x 2 tokens per step)."""
    from megatron.trainer.loop.training import emulate

    initial: dict[str, torch.Tensor] = {}

    def run(partition: str) -> tuple[dict[str, torch.Tensor], list]:
        task = GPTTask()
        parser = build_parser("gpt")
        task.add_arguments(parser)
        config = parse_run_plan([*TINY, "--pipeline-model-parallel-size", "2", "--num-layers", "4",
                                   "--hidden-size", "16", "--num-attention-heads", "2", "--vocab-size", "256",
                                   "--hidden-dropout", "0", "--attention-dropout", "0",
                                   "--lr-decay-style", "constant",  # (cosine: lr 0 at step 1)
                                   "--pipeline-partition", partition], parser)
        if not initial:  # stage 0's weights before training (initialisation depends on names only)
            initial.update((n, p.detach().clone()) for n, p in task.named_parameters(task.build_stage(config, 0, "cpu")))
        workers = emulate(task, config)
        assert [len(w.setup.chunks[0].layers) for w in workers] == ([3, 1] if partition == "balanced" else [2, 2])
        assert all(w.setup.optimizer.step_count == 1 for w in workers)  # it trained
        named = [(n, p) for w in workers for n, p in task.named_parameters(w.setup.chunks)]
        return {n: p.detach().clone() for n, p in named}, named

    balanced, _ = run("balanced")
    with trace_adam() as trace:
        even, named = run("even")
    assert balanced.keys() == even.keys()
    assert any(not torch.equal(even[n], p) for n, p in initial.items()), "no update: the test could not fail"
    rho = gpt_gradient_noise(4, 16, 64, 256, 8 * 2)
    assert_within_bounds(balanced, even, {n: trace.bound(n, p, rho) for n, p in named})


def test_refusals_are_one_line() -> None:
    with pytest.raises(ConfigError, match="drop --pipeline-layer-split"):
        from megatron.trainer.plan.parse import check_args

        args = build_parser("t").parse_args([*ISSUE, "--pipeline-model-parallel-size", "2",
                                             "--pipeline-layer-split", "4", "4", "--pipeline-partition", "balanced"])
        check_args(args)


def test_resume_keeps_the_checkpoints_split(tmp_path) -> None:
    """A checkpoint saved on the even split (say, before the balanced default) resumes on it:
    the default takes the ``--load`` checkpoint's split instead of deciding again."""
    from megatron.trainer.loop.training import emulate

    task = GPTTask()
    flags = [*TINY, "--pipeline-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "16",
             "--num-attention-heads", "2", "--vocab-size", "256"]

    def parsed(extra: list[str]) -> RunPlan:
        parser = build_parser("gpt")
        task.add_arguments(parser)
        return parse_run_plan([*flags, *extra], parser)

    assert parsed([]).layers.counts == [3, 1]
    emulate(task, parsed(["--pipeline-partition", "even", "--save", str(tmp_path), "--save-interval", "1"]))
    resumed = parsed(["--load", str(tmp_path), "--train-iters", "2"])
    assert resumed.layers.counts is None and resumed.layers.partition == "checkpoint"
    assert layer_split_line(resumed) == "layer split: [2, 2] (the --load checkpoint's)"


def test_profiled_partition_runs_for_bert(capsys: pytest.CaptureFixture[str]) -> None:
    """``--pipeline-partition profiled`` measures a BERT's layer, embedding and heads too."""
    from megatron.trainer.loop.training import emulate
    from megatron.trainer.tasks.bert import BertTask

    task = BertTask()
    parser = build_parser("bert")
    task.add_arguments(parser)
    config = parse_run_plan([*TINY, "--pipeline-model-parallel-size", "2", "--num-layers", "3",
                               "--hidden-size", "16", "--num-attention-heads", "2", "--vocab-size", "64",
                               "--pipeline-partition", "profiled", "--pipeline-partition-profile-iters", "1"], parser)
    workers = emulate(task, config)
    assert "pipeline partition profiled: layer split" in capsys.readouterr().out
    assert sum(len(w.setup.chunks[0].layers) for w in workers) == 3
