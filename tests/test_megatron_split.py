"""Megatron-LM's pipeline-split flags give the split Megatron-LM computes.

The expected splits are Megatron-LM's own documented cases (facts, not code): its unit tests
``tests/unit_tests/transformer/test_transformer_block.py`` (TestPipelineParallelTransformerBlock:
"Uneven PP 6*[8]+[6]+[6]=60", ...), ``test_transformer_layer.py`` ("30 layers: 8+6+6+10"),
``test_cuda_graphs.py`` (first/last layer numbers per stage), the layout examples of
``docs/user-guide/features/pipeline_parallel_layout.md`` and the ``--pipeline-model-parallel-layout``
help text of ``megatron/training/arguments.py``.
"""
from __future__ import annotations

import pytest

from megatron.trainer.plan.parse import parse_args
from megatron.trainer.config.errors import ConfigError
from megatron.trainer.plan.build import build_run_plan
from megatron.trainer.config.megatron_split_args import accounted_split, layout_split, parse_layout, uneven_split
from megatron.trainer.tasks.balanced_partition import layer_split_line


@pytest.mark.parametrize("layers,pp,first,last,counts", [
    (60, 8, 6, 6, [6] + [8] * 6 + [6]),  # "Uneven PP 6*[8]+[6]+[6]=60"
    (60, 5, None, 4, [14, 14, 14, 14, 4]),  # "Last pipeline stage has specified layers"
    (60, 6, 5, None, [5, 11, 11, 11, 11, 11]),  # "First pipeline stage has specified layers"
    (30, 4, 8, 10, [8, 6, 6, 10]),  # "30 layers: 8+6+6+10"
    (12, 4, 2, 2, [2, 4, 4, 2]),  # first layer numbers [1, 3, 7, 11], last [2, 6, 10, 12]
])
def test_decoder_first_last_pipeline_num_layers(layers, pp, first, last, counts) -> None:
    assert uneven_split(layers, pp, first, last) == counts


@pytest.mark.parametrize("layers,pp,first,last", [(101, 8, 13, 13), (61, 4, 12, None)])  # Megatron: errors
def test_uneven_split_that_megatron_refuses(layers, pp, first, last) -> None:
    with pytest.raises(ConfigError):
        uneven_split(layers, pp, first, last)


@pytest.mark.parametrize("layers,pp,embedding,loss,counts", [
    (63, 4, True, False, [15, 16, 16, 16]),  # "Include embedding in pipeline split without virtual PP"
    (63, 4, False, True, [16, 16, 16, 15]),  # "Include loss in pipeline split without virtual PP"
    (62, 4, True, True, [15, 16, 16, 15]),  # "Include embedding and loss in pipeline split"
    (14, 4, True, True, [3, 4, 4, 3]),  # first layer numbers [1, 4, 8, 12], last [3, 7, 11, 14]
])
def test_account_for_embedding_and_loss(layers, pp, embedding, loss, counts) -> None:
    assert accounted_split(layers, pp, embedding, loss) == counts
    assert sum(counts) == layers


def test_accounted_split_megatron_refuses() -> None:  # "num_layers not divisible ... with embedding/loss"
    with pytest.raises(ConfigError):
        accounted_split(65, 4, True, True)


def test_layout_examples_parse_as_megatron_documents() -> None:
    # the user guide's DeepSeek-V3 example, PP 16 x VPP 2: rank 0 holds E + 3 t then 2 t, ranks
    # 1-13 2 t and 2 t, rank 14 2 t then the MTP layer, rank 15 2 t then the loss
    stages = parse_layout("Et*3|(tt|)*29,m|L")
    assert len(stages) == 32 and stages[0] == "Ettt" and stages[1:30] == ["tt"] * 29
    assert stages[30:] == ["m", "L"]
    pp = 16
    assert stages[0 * pp + 14] == "tt" and stages[1 * pp + 14] == "m" and stages[1 * pp + 15] == "L"
    # arguments.py's help example and the guide's empty-stage example
    assert parse_layout("E|(t|)*3,m|m||L") == ["E", "t", "t", "t", "m", "m", "", "L"]
    assert parse_layout("E||t|L") == ["E", "", "t", "L"]


@pytest.mark.parametrize("layout,layers,pp,counts", [
    ("Et|tt|tt|tt|tt|tt|tt|tL", 14, 4, [1] + [2] * 6 + [1]),  # test_cuda_graphs' 14-layer PP 4 x VPP 2 layout
    ("E|t*4|L", 4, 3, [0, 4, 0]),
    ("Ett|(tt|)*2,ttL", 8, 2, [2, 2, 2, 2]),
])
def test_layout_split_counts_transformer_layers_per_virtual_stage(layout, layers, pp, counts) -> None:
    assert layout_split(layout, layers, pp) == counts


def _args(*flags: str):
    return parse_args(["--pipeline-executor", "emulator", *flags])


def test_flags_set_the_split_and_the_banner_names_them() -> None:
    first_last = _args("--num-layers", "12", "--pipeline-model-parallel-size", "4",
                       "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "2")
    assert build_run_plan(first_last).layers.counts == [2, 4, 4, 2]
    assert layer_split_line(build_run_plan(first_last)) == ("layer split: [2, 4, 4, 2] (--decoder-first-pipeline-num-layers "
                                            "--decoder-last-pipeline-num-layers)")
    accounted = _args("--num-layers", "14", "--pipeline-model-parallel-size", "4",
                      "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")
    assert build_run_plan(accounted).layers.counts == [3, 4, 4, 3]
    # even, yet spelled out: the default balanced partition does not move a split the user chose
    layout = _args("--num-layers", "4", "--pipeline-model-parallel-size", "2",
                   "--pipeline-model-parallel-layout", "Et*2|t*2L")
    layers = build_run_plan(layout).layers
    assert layers.counts == [2, 2] and layers.partition == "explicit"
    virtual = _args("--num-layers", "8", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
                    "--pipeline-schedule", "interleaved-1f1b", "--pipeline-model-parallel-layout", "Ett|(tt|)*2,ttL")
    assert virtual.num_model_chunks == 2 and virtual.num_layers_per_virtual_pipeline_stage == 2
    assert layer_split_line(build_run_plan(virtual)).endswith("(--pipeline-model-parallel-layout)")


def test_a_layout_split_trains(megatron_world1) -> None:
    """The split reaches the model: stage s builds the layers the layout gives it."""
    from async_helpers import emulate, named_parameters, tiny_args

    argv = tiny_args(2, "1f1b", 2, 1, "--pipeline-executor", "emulator", "--pipeline-model-parallel-layout", "Et|tttL")
    argv[argv.index("--num-layers") + 1] = "4"
    workers = emulate(argv)
    layers = [sorted({int(n.split(".")[2]) for n, _ in named_parameters(w) if ".layers." in n}) for w in workers]
    assert layers == [[0], [1, 2, 3]]
