"""Checkpoints across tensor-parallel sizes (issue 15, item 6).

References are independent of the code under test: a TP = 2 checkpoint loaded at TP = 1 must
hold the shards *gathered* by the collective (``gather_full``), a TP = 1 checkpoint loaded at
TP = 2 must hold ``take_shard`` of the full tensors (the slicing the model's own initialisation
uses), parameters and AdamW moments alike; the first loss after loading equals the loss the
saved TP = 2 stage computes on the same batch (<= 1e-5 relative); the same layout loads file
for file, bitwise. The SwiGLU model makes fc1 a stride-2 shard. One spawn of two gloo ranks
runs the stage-level checks with real workers (``build_worker``) and the checkpoint functions
directly; the runtime-level "(TP1, PP4) resumes at (TP2, PP2) and at (TP1, PP2, DP2)" runs
through ``pretrain_gpt.py`` (its TP half skips while the runtime refuses TP).
"""
from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from async_helpers import TINY_GPT, emulate, run_pretrain
from gloo_ranks import run_on_two_gloo_ranks

from megatron.trainer.checkpointing import checkpoint as ckpt
from megatron.trainer.checkpointing import reshard
from megatron.trainer.checkpointing.paths import rank_file_coordinates, rank_file_name
from megatron.trainer.checkpointing.shards import ShardError, plan_region, shard_entry
from megatron.trainer.plan.parse import parse_args, parse_run_plan
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.models.tensor_parallel import ShardLayout, take_shard

REL_TOL = 1e-5
# Tiny GPT with GQA and SwiGLU (fc1 is a stride-2 TP shard); 2 layers, hidden 32.
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--swiglu", "--ffn-hidden-size", "48", "--seq-length", "16", "--max-position-embeddings", "16",
         "--vocab-size", "64", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "10",
         "--lr", "1e-2", "--lr-warmup-iters", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--num-threads", "1"]

# -- shard regions, no processes ----------------------------------------------------------------


def _saved_shards(full: torch.Tensor, layout: ShardLayout | None, size: int) -> tuple[list, dict]:
    """Index holders and tensors of ``full`` saved at TP ``size`` (one file per TP rank)."""
    holders, tensors = [], {}
    for rank in range(size):
        shard = take_shard(full, layout, rank, size)
        holders.append((f"tp{rank}", shard_entry(tuple(shard.shape), layout if size > 1 else None, rank, size)))
        tensors[f"tp{rank}"] = shard
    return holders, tensors


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("dim", [0, 1])
def test_regions_reshard_every_tp_size_to_every_other(stride: int, dim: int) -> None:
    """Saved at T, loaded at T': each rank's region is take_shard of the full tensor at T', and
    with T = T' it reads exactly its own file."""
    full = torch.randn(16, 8) if dim == 0 else torch.randn(8, 16)
    layout = ShardLayout(dim, stride)
    for saved_size in (1, 2, 4):
        holders, tensors = _saved_shards(full, layout, saved_size)
        for size in (1, 2, 4):
            for rank in range(size):
                want = take_shard(full, layout, rank, size)
                region = plan_region("w", holders, layout, rank, size, tuple(want.shape), (0, 0))
                got = region.assemble(torch.full_like(want, float("nan")), tensors)
                assert torch.equal(got, want), (saved_size, size, rank)
                if saved_size == size:
                    assert region.files == [f"tp{rank}"]
                elif saved_size == 1:
                    assert region.files == ["tp0"]


def test_stride_two_entries_describe_their_blocks() -> None:
    """The index entry of SwiGLU fc1's TP shard: two blocks, the k-th at offset + k * rows / 2."""
    entry = shard_entry((6, 4), ShardLayout(0, 2), 1, 2)  # rank 1 of 2: full rows 12, blocks of 3
    assert entry["global_shape"] == [12, 4] and entry["offset"] == [3, 0]
    assert entry["tensor_parallel"] == {"dim": 0, "stride": 2, "rank": 1, "size": 2}
    full = torch.arange(12.0).view(12, 1).expand(12, 4)
    assert take_shard(full, ShardLayout(0, 2), 1, 2)[:, 0].tolist() == [3, 4, 5, 9, 10, 11]


def test_padded_vocabulary_rows_reshard() -> None:
    """Padded vocab 40 at TP 2 -> 48 at TP 4: rows past 40 keep this run's values; 48 -> 40
    drops the saved padding rows; any other shape change is refused."""
    layout = ShardLayout(0, 1)
    full = torch.randn(40, 4)
    holders, tensors = _saved_shards(full, layout, 2)
    fresh = torch.randn(48, 4)
    for rank in range(4):
        current = take_shard(fresh, layout, rank, 4)
        got = plan_region("emb", holders, layout, rank, 4, (12, 4), (40, 48)).assemble(current, tensors)
        want = take_shard(torch.cat([full, fresh[40:]]), layout, rank, 4)
        assert torch.equal(got, want)
    big = torch.randn(48, 4)
    holders, tensors = _saved_shards(big, layout, 4)
    got = plan_region("emb", holders, layout, 0, 1, (40, 4), (48, 40)).assemble(torch.zeros(40, 4), tensors)
    assert torch.equal(got, big[:40])
    with pytest.raises(ShardError, match=r"has shape \(48, 4\) in the checkpoint, the model has \(40, 4\)"):
        plan_region("w", holders, layout, 0, 1, (40, 4), (0, 0))


def test_vocabulary_padding_may_change_the_tokenizer_may_not() -> None:
    saved = {"vocab_size": 50304, "tokenizer_vocab_size": 50257}
    assert not reshard.check_vocab(saved, dict(saved), "here")
    assert reshard.check_vocab(saved, {**saved, "vocab_size": 50432}, "here")
    for ours in ({"vocab_size": 50432, "tokenizer_vocab_size": 50000}, {"vocab_size": 64, "tokenizer_vocab_size": None}):
        with pytest.raises(reshard.ReshardError, match="was saved with --vocab-size 50304, this run has"):
            reshard.check_vocab(saved, ours, "here")
    with pytest.raises(reshard.ReshardError):  # mock data: no tokenizer, so no rows are padding
        reshard.check_vocab({"vocab_size": 32}, {"vocab_size": 64}, "here")


def test_file_names_without_tp_are_unchanged() -> None:
    assert rank_file_name(3, 1) == "stage03_dp1.pt" == rank_file_name(3, 1, 0, 1)
    assert rank_file_name(3, 1, 1, 2) == "stage03_dp1_tp1.pt"
    assert rank_file_coordinates("stage03_dp1_tp1.pt") == (3, 1, 1)
    assert rank_file_coordinates("stage03_dp1.pt") == (3, 1, 0)
    assert rank_file_coordinates("metadata.json") is None


def _tp2_metadata() -> dict:
    """A one-stage TP 2 checkpoint's metadata (one sharded and one replicated parameter)."""
    signature = {"pipeline_model_parallel_size": 1, "data_parallel_size": 1, "num_microbatches": 2,
                 "micro_batch_size": 1, "pipeline_schedule": "1f1b", "tensor_model_parallel_size": 2}
    index = {rank_file_name(0, 0, r, 2): {"stage": 0, "step_count": 3, "params": {
        "w": shard_entry((4, 2), ShardLayout(0, 1), r, 2), "b": shard_entry((2,), None, r, 2)}} for r in range(2)}
    return {"signature": signature, "index": index}


def test_plan_across_tp_sizes(tmp_path: Path) -> None:
    """TP 2 -> TP 1: shards come from both TP files, replicated tensors from TP rank 0's; per-rank
    state is reset (notice); basis rotation's per-shard bases are refused unless --no-load-optim."""
    metadata = _tp2_metadata()
    ours = {**metadata["signature"], "tensor_model_parallel_size": 1}
    plan = reshard.plan(metadata, ours, parse_run_plan(MODEL), "here")
    assert plan.holders["w"] == (rank_file_name(0, 0, 0, 2), rank_file_name(0, 0, 1, 2))
    assert plan.region("b", None, 0, 1, (2,)).files == [rank_file_name(0, 0, 0, 2)]
    assert plan.region("w", ShardLayout(0, 1), 0, 1, (8, 2)).files == list(plan.holders["w"])
    assert not plan.keeps_rank_state and plan.stage_file(0, 0) == rank_file_name(0, 0, 0, 2)
    assert plan.notices[0] == "resharding the checkpoint from TP2 PP1 DP1 1f1b to PP1 DP1 1f1b"
    assert "tensor-parallel size changed: dropout RNG streams restart" in plan.notices[1]
    rotation = ("--optimizer", "basis-rotation", "--load", str(tmp_path))
    with pytest.raises(reshard.ReshardError, match="basis rotation's bases belong to one tensor-parallel shard"):
        reshard.plan(metadata, ours, parse_run_plan([*MODEL, *rotation]), "here")
    assert not reshard.plan(metadata, ours, parse_run_plan([*MODEL, *rotation, "--no-load-optim"]), "here").load_optimizer
    same = reshard.plan(metadata, {**ours, "tensor_model_parallel_size": 2, "num_microbatches": 1,
                                   "micro_batch_size": 2}, parse_run_plan(MODEL), "here")
    assert same.keeps_rank_state and same.stage_file(0, 0, 1) == rank_file_name(0, 0, 1, 2)
    assert same.region("w", ShardLayout(0, 1), 1, 2, (4, 2)).files == [rank_file_name(0, 0, 1, 2)]


def test_plan_reshards_vocabulary_padding() -> None:
    """TP 2 -> TP 4 with a tokenizer of 60 tokens padded to 64 and then 128: a plan with a notice,
    whose embedding region keeps rows 64.. from this run."""
    metadata = _tp2_metadata()
    metadata["signature"].update(vocab_size=64, tokenizer_vocab_size=60)
    metadata["index"] = {f: {**entry, "params": {"emb": shard_entry((32, 2), ShardLayout(0, 1), r, 2)}}
                         for r, (f, entry) in enumerate(sorted(metadata["index"].items()))}
    ours = {**metadata["signature"], "tensor_model_parallel_size": 4, "vocab_size": 128}
    plan = reshard.plan(metadata, ours, parse_run_plan(MODEL), "here")
    assert plan.vocab == (64, 128) and any("padded vocabulary 64 -> 128" in n for n in plan.notices)
    assert plan.region("emb", ShardLayout(0, 1), 1, 4, (32, 2)).files == [rank_file_name(0, 0, 1, 2)]
    assert plan.region("emb", ShardLayout(0, 1), 2, 4, (32, 2)).files == []  # rows 64..95: all padding


def test_checkpoints_before_tp_are_tp1() -> None:
    """A signature without the TP size (saved before it was recorded) is TP 1: same layout."""
    assert reshard.tp_size(reshard.saved_signature({"signature": {"pipeline_model_parallel_size": 2}})) == 1


# -- real TP stages on two gloo ranks -----------------------------------------------------------

def _config(tp: int, pp: int = 1, *more: str) -> RunPlan:
    """Parsed at TP 1 (the runtime's parser refuses TP until it runs TP), then set to ``tp``."""
    config = parse_run_plan([*MODEL, "--pipeline-model-parallel-size", str(pp), *more])
    return config.replace_in("parallel", tensor_model_parallel_size=tp)


def _worker(config: RunPlan, stage: int = 0):
    from megatron.trainer.loop.training import build_worker
    from megatron.trainer.tasks.gpt import GPTTask

    return build_worker(GPTTask(), config, stage, 0, torch.device("cpu"), isolate_rng=True)


def _loss(workers: list, batch: dict) -> torch.Tensor:
    """Forward through the stages in order (one process holds them all); the LM loss."""
    from megatron.trainer.tasks.gpt import GPTTask

    x = None
    for w in workers:
        for chunk in w.setup.chunks:
            x = chunk(x, batch)
    return GPTTask().loss_fn(x, batch)[0]


def _train_step(worker, batch: dict) -> None:
    _loss([worker], batch).backward()
    worker.setup.optimizer.step(1e-2)
    for p in worker.setup.optimizer.parameters():
        p.grad = None


def _save(workers: list, config: RunPlan, root: Path, iteration: int, rank: int, writers: int) -> None:
    """The runtime's save sequence: staging by the coordinator, each TP rank's files, publish."""
    import torch.distributed as dist
    from megatron.trainer.tasks.gpt import GPTTask

    if rank == 0:
        ckpt.prepare_staging(root, iteration)
    dist.barrier()
    for worker in workers if rank < writers else ():
        ckpt.write_rank_file(root, iteration, worker.stage, 0, ckpt.stage_state(GPTTask(), worker))
    dist.barrier()
    if rank == 0:
        ckpt.publish(root, iteration, ckpt.run_signature(GPTTask(), config), config.parallel.pipeline_model_parallel_size, 1)
    dist.barrier()


def _load(config: RunPlan, root: Path, stages: int = 1) -> tuple[list, ckpt.ResumePoint]:
    from megatron.trainer.tasks.gpt import GPTTask

    config = config.replace_in("checkpoint", load=str(root))
    point = ckpt.check_resume(GPTTask(), config)
    assert point is not None
    workers = [_worker(config, s) for s in range(stages)]
    for w in workers:
        ckpt.load_stage_state(GPTTask(), w, point, 0)
    return workers, point


def _full_state(worker) -> dict[str, torch.Tensor]:
    """Parameters and AdamW moments gathered over the TP group (``name``, ``name/exp_avg``, ...)."""
    from megatron.trainer.models.tensor_parallel import gather_full, shard_layout, stage_tp_group
    from megatron.trainer.tasks.gpt import GPTTask

    group = stage_tp_group(worker.setup.chunks[0].model)
    moments = worker.setup.optimizer.state_dict()["params"]
    out = {}
    for name, p in GPTTask().named_parameters(worker.setup.chunks):
        layout = shard_layout(p)
        out[name] = gather_full(p.detach(), layout, group)
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}/{key}"] = gather_full(moments[name][key], layout, group)
    return out


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return float((got - ref).abs().max()) <= REL_TOL * float(ref.abs().max())


def _assert_shards_of(task, worker, full: dict[str, torch.Tensor], rank: int) -> None:
    """Each parameter and moment of a TP 2 ``worker`` is ``take_shard`` of ``full``'s."""
    from megatron.trainer.models.tensor_parallel import shard_layout

    moments = worker.setup.optimizer.state_dict()["params"]
    strides = set()
    for name, p in task.named_parameters(worker.setup.chunks):
        layout = shard_layout(p)
        strides.add(None if layout is None else layout.stride)
        assert torch.equal(p.detach(), take_shard(full[name], layout, rank, 2)), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(moments[name][key], take_shard(full[f"{name}/{key}"], layout, rank, 2)), (name, key)
    assert strides == {None, 1, 2}


def _tp_ranks(rank: int, out: str) -> None:
    from megatron.core import parallel_state
    from megatron.trainer.models.tensor_parallel import initialize_tensor_parallel
    from megatron.trainer.tasks.gpt import GPTTask

    root = Path(out)
    task = GPTTask()
    batches = [task.batch_fn(_config(1), 0, torch.device("cpu"))(m) for m in range(3)]

    # TP 2: two updates (moments non-zero), saved at "iteration 2"; the next batch's loss.
    initialize_tensor_parallel(2)
    w2 = _worker(_config(2))
    for batch in batches[:2]:
        _train_step(w2, batch)
    _save([w2], _config(2), root / "tp2", 2, rank, writers=2)
    full2, shards2 = _full_state(w2), {n: p.detach().clone() for n, p in task.named_parameters(w2.setup.chunks)}
    with torch.no_grad():
        next_loss2 = _loss([w2], batches[2])
    index = json.loads((ckpt.iteration_dir(root / "tp2", 2) / ckpt.METADATA).read_text())["index"]
    assert sorted(index) == ["stage00_dp0_tp0.pt", "stage00_dp0_tp1.pt"]
    fc1 = index["stage00_dp0_tp1.pt"]["params"]["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1["tensor_parallel"] == {"dim": 0, "stride": 2, "rank": 1, "size": 2}, fc1

    # The same layout: file for file (no reshard plan), bitwise.
    same, point = _load(_config(2), root / "tp2")
    assert point.reshard is None
    for name, p in task.named_parameters(same[0].setup.chunks):
        assert torch.equal(p.detach(), shards2[name]), name

    # TP 2 -> TP 1, one stage and split over two stages: the gathered tensors, the same loss.
    initialize_tensor_parallel(1)
    for stages in (1, 2):
        workers, point = _load(_config(1, stages), root / "tp2", stages)
        assert point.reshard is not None and not point.reshard.same_tp
        loaded = {k: v for w in workers for k, v in _full_state(w).items()}
        assert loaded.keys() == full2.keys()
        for key, value in full2.items():
            assert torch.equal(loaded[key], value), f"TP2 -> TP1 x PP{stages}: {key}"
        assert all(w.setup.optimizer.step_count == 2 for w in workers)
        with torch.no_grad():
            assert _close(_loss(workers, batches[2]), next_loss2), "first loss after loading at TP1"
    _save(workers, _config(1, 2), root / "tp1pp2", 2, rank, writers=1)  # (TP1, PP2), for TP2 x PP1 below
    fresh, load = _worker(_config(1)), _config(1, 1, "--load", str(root / "tp2"), "--no-load-optim")
    ckpt.load_stage_state(task, fresh, ckpt.check_resume(task, load), 0, optimizer=False)  # weights only
    assert fresh.setup.optimizer.step_count == 0
    assert all(torch.equal(v, full2[k]) for k, v in _full_state(fresh).items() if "/" not in k)
    w1 = _load(_config(1), root / "tp2")[0][0]
    _train_step(w1, batches[2])  # TP 1 moves on, then saves (rank 0 writes, TP 1 has one file)
    _save([w1], _config(1), root / "tp1", 3, rank, writers=1)
    full1 = _full_state(w1)
    with torch.no_grad():
        loss1 = _loss([w1], batches[0])

    # TP 1 -> TP 2: every tensor is take_shard of the full one (fc1 with stride 2), same loss;
    # from one stage and from two (stage files joined and cut into TP shards at once).
    initialize_tensor_parallel(2)
    for checkpoint, full, batch, loss in (("tp1", full1, batches[0], loss1), ("tp1pp2", full2, batches[2], next_loss2)):
        (w2b,), point = _load(_config(2), root / checkpoint)
        assert point.reshard is not None
        _assert_shards_of(task, w2b, full, rank)
        with torch.no_grad():
            assert _close(_loss([w2b], batch), loss), f"first loss after loading {checkpoint} at TP2"
    parallel_state.destroy_model_parallel()


def test_tp2_and_tp1_checkpoints_load_into_each_other(tmp_path: Path) -> None:
    run_on_two_gloo_ranks(_tp_ranks, str(tmp_path), timeout_s=300)  # a shared CI machine; ~15 s of CPU


# -- through the runtime: (TP1, PP4) resumes at (TP2, PP2) and at (TP1, PP2, DP2) ----------------

SAVED, TOTAL = 3, 5


def _argv(pp: int, *more: str) -> list[str]:
    return [*TINY_GPT, "--num-layers", "4", "--pipeline-model-parallel-size", str(pp), "--global-batch-size", "4",
            "--train-iters", str(TOTAL), "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
            *more]


def _runtime_refuses_tp() -> bool:
    """Whether argument validation still refuses --tensor-model-parallel-size 2 for the runtime."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parse_args(_argv(2, "--tensor-model-parallel-size", "2", "--pipeline-executor", "distributed",
                             "--device", "cpu"))
    except SystemExit:
        return True
    return False


@pytest.fixture(scope="module")
def pp4(megatron_world1, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float]]:
    """(TP1, PP4) 1f1b (emulator) saved at iteration 3 and continued to 5: (checkpoint, losses)."""
    root = tmp_path_factory.mktemp("tp1pp4")
    emulate(_argv(4, "--save", str(root / "all"), "--save-interval", str(SAVED), "--log-json", str(root / "ref.jsonl")))
    checkpoint = root / "ck"
    shutil.copytree(ckpt.iteration_dir(root / "all", SAVED), ckpt.iteration_dir(checkpoint, SAVED))
    (checkpoint / ckpt.POINTER).write_text(f"{SAVED}\n")
    records = [json.loads(line) for line in (root / "ref.jsonl").read_text().splitlines()]
    return checkpoint, {r["iteration"]: r["loss"] for r in records if "loss" in r and "eval_split" not in r}


LAYOUTS = {
    "tp2-pp2": ("--tensor-model-parallel-size", "2"),
    "tp1-pp2-dp2": ("--data-parallel-size", "2"),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    pytest.param("tp2-pp2", marks=pytest.mark.skipif(_runtime_refuses_tp(), reason="the runtime refuses TP > 1")),
    "tp1-pp2-dp2",
])
def test_tp1_pp4_checkpoint_resumes_through_the_runtime(pp4, tmp_path: Path, layout: str) -> None:
    """4 gloo ranks; synchronous 1f1b, so the first and the last loss equal the saved run's."""
    checkpoint, reference = pp4
    records, _ = run_pretrain(_argv(2, "--load", str(checkpoint), "--device", "cpu", *LAYOUTS[layout]), tmp_path)
    losses = {r["iteration"]: r["loss"] for r in records}
    assert sorted(losses) == [SAVED + 1, TOTAL]
    for it in (SAVED + 1, TOTAL):
        assert abs(losses[it] - reference[it]) <= REL_TOL * abs(reference[it]), (layout, losses, reference)
