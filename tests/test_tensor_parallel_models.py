"""Tensor-parallel GPT and BERT stages (issue 15, item 1, the model half) on 2 gloo ranks.

The reference is the same model at TP = 1, built in the same two processes (megatron's
parallel state re-initialised with TP groups of one rank), so every check compares two
independent computations of the same maths:

* init: the TP = 2 shards are the TP = 1 weights sliced (checked slice by slice, and by
  gathering them back);
* one stage, and a 2-stage split run stage by stage in-process (activations handed over by
  hand), at TP = 2: the loss and the gathered parameter gradients equal TP = 1's
  (<= 1e-5 relative), for GPT (GQA + SwiGLU, so the grouped QKV rows and fc1's stride-2
  layout are exercised) and BERT (biases, padding mask, binary head);
* B/W split at TP = 2 (column-parallel input-grad all-reduce in B, weight grads in W) leaves
  bitwise the gradients of the fused backward.

One spawn of two processes runs everything (importing megatron-core dominates its cost).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

SEED = 1234
TIMEOUT_S = 300  # the CI machine is shared; a healthy run takes ~15 s of CPU
REL_TOL = 1e-5


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _gpt_args():
    from megatron.trainer.models.gpt import GPTModelArgs

    return GPTModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                        seq_length=16, max_position_embeddings=16, vocab_size=64, swiglu=True,
                        ffn_hidden_size=48, use_transformer_engine=False)


def _bert_args():
    from megatron.trainer.models.bert import BertModelArgs

    return BertModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                         max_position_embeddings=16, vocab_size=64, use_transformer_engine=False)


def _gpt_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 64, (2, 17), generator=gen)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
            "position_ids": torch.arange(16).expand(2, 16),
            "loss_mask": (torch.rand(2, 16, generator=gen) > 0.2).float()}


def _bert_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(8)
    padding = (torch.arange(16) < torch.tensor([[16], [11]])).long()
    return {"tokens": torch.randint(0, 64, (2, 16), generator=gen),
            "labels": torch.randint(0, 64, (2, 16), generator=gen),
            "loss_mask": ((torch.rand(2, 16, generator=gen) > 0.7) & padding.bool()).float(),
            "padding_mask": padding, "tokentype_ids": (torch.arange(16) >= 8).long().expand(2, 16),
            "sentence_order": torch.tensor([0, 1])}


def _family(name: str):
    """(args, batch, build(args, layers, first, last), loss) of a model family."""
    from megatron.trainer.models.bert import bert_loss, build_bert_stage
    from megatron.trainer.models.gpt import build_gpt_stage, gpt_loss

    if name == "gpt":
        return _gpt_args(), _gpt_batch(), build_gpt_stage, gpt_loss
    return _bert_args(), _bert_batch(), build_bert_stage, bert_loss


def _run(name: str, split: list[range], deferred: bool = False):
    """Loss, gathered grads, gathered initial params, stages and the names left for W of one
    forward/backward, stage by stage (a non-last stage's output gradient is the next stage's
    input gradient)."""
    from megatron.pipeline.runtime.wgrad import DeferredWeightGrads, defer_weight_grads
    from megatron.trainer.models.tensor_parallel import gathered_parameters

    args, batch, build, loss_fn = _family(name)
    stages = [build(args, layers, i == 0, i == len(split) - 1, SEED, "cpu")
              for i, layers in enumerate(split)]
    params = {k: v.clone() for s in stages for k, v in gathered_parameters(s).items()}
    inputs, outputs, x, left_for_w = [], [], None, set()
    for stage in stages:
        x = None if x is None else x.detach().requires_grad_()
        inputs.append(x)
        x = stage(x, batch)
        outputs.append(x)
    loss, _ = loss_fn(x, batch)
    grad = None
    for stage, inp, out in reversed(list(zip(stages, inputs, outputs))):
        store = DeferredWeightGrads() if deferred else None
        with defer_weight_grads(store) if deferred else contextlib.nullcontext():
            if grad is None:
                loss.backward()
            else:
                torch.autograd.backward(out, grad)
        if store is not None:
            left_for_w |= {k for k, p in stage.global_named_parameters() if p.grad is None}
            store.run()
        grad = None if inp is None else inp.grad
    grads = {k: v for s in stages for k, v in gathered_parameters(s, grads=True).items()}
    return loss.detach(), grads, params, stages, left_for_w


def _assert_close(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    scale = ref.abs().max().clamp_min(1e-12)
    err = float((got - ref).abs().max() / scale)
    assert err <= REL_TOL, f"{name}: relative difference {err:.3g} > {REL_TOL}"


def _compare(label: str, got, ref) -> None:
    _assert_close(f"{label} loss", got[0], ref[0])
    assert got[1].keys() == ref[1].keys(), f"{label}: gradients of different parameters"
    for key in ref[1]:
        _assert_close(f"{label} grad {key}", got[1][key], ref[1][key])


def _check_family(name: str, tp1: dict, tp2: dict) -> None:
    from megatron.core import parallel_state
    from megatron.trainer.models.tensor_parallel import shard_layout, take_shard

    rank = parallel_state.get_tensor_model_parallel_rank()
    ref_params = tp1["one"][2]
    assert tp2["one"][2].keys() == ref_params.keys()
    for key, full in ref_params.items():  # init: gathered shards are the TP = 1 weights
        assert torch.equal(tp2["one"][2][key], full), f"{name} init of {key} differs from TP=1"
    sharded = 0
    for key, param in tp2["one"][3][0].global_named_parameters():  # and each shard is its slice
        layout = shard_layout(param)
        sharded += layout is not None
        assert torch.equal(param.detach(), take_shard(ref_params[key], layout, rank, 2)), key
    assert sharded > 0, f"{name}: nothing is tensor-parallel at TP=2"
    _compare(f"{name} 1 stage TP=2", tp2["one"], tp1["one"])
    _compare(f"{name} 2 stages TP=2", tp2["two"], tp1["one"])
    _compare(f"{name} 2 stages TP=1", tp1["two"], tp1["one"])


def _check_bw_split() -> None:
    """B then W equals the fused backward bitwise, locally on each TP rank."""
    fused = _run("gpt", [range(0, 2)])
    split = _run("gpt", [range(0, 2)], deferred=True)
    # Column-parallel (all-reducing dx in B) and row-parallel linears both left dW to W.
    for layer in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
        assert f"decoder.layers.1.{layer}.weight" in split[4], f"{layer} computed dW in B"
    assert torch.equal(split[0], fused[0])
    fused_grads = dict(fused[3][0].global_named_parameters())
    for key, param in split[3][0].global_named_parameters():
        assert torch.equal(param.grad, fused_grads[key].grad), f"B/W split grad of {key}"


def _worker(rank: int, port: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.trainer.models.tensor_parallel import initialize_tensor_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        results: dict[int, dict[str, dict]] = {}
        for tp in (1, 2):
            initialize_tensor_parallel(tp)
            results[tp] = {
                name: {"one": _run(name, [range(0, 2)]), "two": _run(name, [range(0, 1), range(1, 2)])}
                for name in ("gpt", "bert")
            }
        for name in ("gpt", "bert"):
            _check_family(name, results[1][name], results[2][name])
        _check_bw_split()
        parallel_state.destroy_model_parallel()
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_stages_match_tp1() -> None:
    context = mp.start_processes(_worker, args=(_free_port(),), nprocs=2, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"tensor-parallel workers did not finish in {TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()


def test_shard_layout_roundtrip_without_processes() -> None:
    """take_shard with stride 2 picks the [gate_r; up_r] blocks megatron's SwiGLU fc1 holds."""
    from megatron.trainer.models.tensor_parallel import ShardLayout, take_shard

    full = torch.arange(8).view(8, 1)  # gate rows 0..3, up rows 4..7
    layout = ShardLayout(dim=0, stride=2)
    assert take_shard(full, layout, 0, 2).view(-1).tolist() == [0, 1, 4, 5]
    assert take_shard(full, layout, 1, 2).view(-1).tolist() == [2, 3, 6, 7]
    columns = torch.arange(12).view(2, 6)
    assert take_shard(columns, ShardLayout(dim=1, stride=1), 1, 2).tolist() == [[3, 4, 5], [9, 10, 11]]
