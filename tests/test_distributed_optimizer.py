"""``--use-distributed-optimizer`` (ZeRO-1 over the data-parallel group) and ``--overlap-param-gather``.

The reference is always the unsharded optimizer on the same averaged gradients:

* the mechanism, on two gloo ranks without the trainer, in fp32, bf16 and fp16 (fp32 masters):
  the reduce-scatter gives each replica the average of its range, the squared norm summed over
  the replicas is the full one, a step of the shards followed by the all-gather gives the
  unsharded step's parameters bitwise, the rollback (in place and exact) undoes it like the
  unsharded rollback, a non-finite gradient on one replica makes the norm non-finite on both
  (fp16's found_inf agrees), the state shrinks to about half, and an overlapped gather leaves
  the other replica's range untouched until it is waited for, then gives the same bits;
* end to end, PP=2 x DP=2 on gloo, fp32, no dropout: the distributed optimizer equals the
  replicated one for 1F1B, PACI (stage-local steps) and 1F1B with post-validation where an
  injected non-finite gradient on stage 1 makes stage 0 roll its optimistic step back; the
  overlapped gather equals the non-overlapped one bitwise;
* a same-layout resume of a sharded checkpoint is bitwise, the index marks it sharded, and a run
  with whole optimizer states refuses it up front (unless ``--no-load-optim``);
* at TP > 1 (two gloo ranks as one TP group), the norm of the own ranges counts the TP-sharded
  squares over TP and the replicated ones once, the same bits on every rank (TP2 x DP2 end to
  end and its checkpoints: ``tests/test_tensor_parallel_runtime.py``);
* on two GPUs (``gpu``-marked), the NCCL collectives of the same path;
* the refusals are one line.
"""
from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch

from tests.async_helpers import assert_flag_error, run_pretrain, tiny_args
from tests.gloo_ranks import run_on_two_gloo_ranks

pytestmark = pytest.mark.numerics  # re-run by .ci/run under a second ATEN_CPU_CAPABILITY

TIMEOUT = datetime.timedelta(seconds=60)


def _named(dtype: torch.dtype) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters of odd sizes (33 elements in all: the ranges split a parameter)."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"a.weight": (3, 4), "a.bias": (3,), "b.weight": (2, 7), "b.bias": (4,)}
    return [(name, torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))) for name, shape in shapes.items()]


def _set_grads(named, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(100 * step + rank)
    for _, p in named:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _mean_grads(named) -> None:
    """The unsharded path's average over the replicas: one all-reduce of the flat gradients."""
    import torch.distributed as dist

    flat = torch.cat([p.grad.reshape(-1) for _, p in named])
    dist.all_reduce(flat)
    flat /= 2
    for (_, p), g in zip(named, flat.split([p.numel() for _, p in named])):
        p.grad.copy_(g.view_as(p))


def _assert_params_equal(got, want) -> None:
    for (name, p), (_, q) in zip(got, want):
        assert torch.equal(p.data, q.data), name


def _check(rank: int, dtype: torch.dtype, exact: bool) -> None:
    from megatron.pipeline.runtime.distributed_optimizer import DataParallelShardedOptimizer, data_parallel_shards
    from megatron.trainer.optim.adamw import StageAdamW

    hyper = dict(lr=1e-2, weight_decay=0.1, exact=exact)
    for overlap in (False, True):
        ref_named, named = _named(dtype), _named(dtype)
        ref = StageAdamW(ref_named, **hyper)
        opt = DataParallelShardedOptimizer(StageAdamW(named, shards=data_parallel_shards(named, 2, rank), **hyper),
                                           rank, 2, overlap_param_gather=overlap)
        opt.attach(None, TIMEOUT)
        assert 0.4 < opt.state_bytes() / ref.state_bytes() < 0.6
        for step in range(3):
            _set_grads(ref_named, rank, step)
            _set_grads(named, rank, step)
            _mean_grads(ref_named)
            opt.reduce_gradients()
            lo, hi = opt.lo, opt.hi
            mine = torch.cat([p.grad.reshape(-1) for _, p in named])[lo:hi]
            assert torch.equal(mine, torch.cat([p.grad.reshape(-1) for _, p in ref_named])[lo:hi])
            full = float(ref.grad_sq_norm())
            assert float(opt.grad_sq_norm()) == pytest.approx(full, rel=1e-6)
            before = [p.data.clone() for _, p in named]
            ref.step(1e-2, grad_scale=0.5)
            opt.step(1e-2, grad_scale=0.5)
            if overlap:  # nothing of the other replica's range arrives before the wait
                other = torch.cat([p.data.reshape(-1) for _, p in named]).float()
                old = torch.cat([b.reshape(-1) for b in before]).float()
                outside = torch.ones_like(old, dtype=torch.bool)
                outside[lo:hi] = False
                assert torch.equal(other[outside], old[outside])
                opt.wait_params()
            _assert_params_equal(named, ref_named)
            if step == 1:  # post-validation's rollback, on the shards, then the step again
                ref.rollback(1e-2, grad_scale=0.5)
                opt.rollback(1e-2, grad_scale=0.5)
                opt.wait_params()
                _assert_params_equal(named, ref_named)
                ref.step(1e-2, grad_scale=0.25)
                opt.step(1e-2, grad_scale=0.25)
                opt.wait_params()
                _assert_params_equal(named, ref_named)
            ref.zero_grad()
            opt.zero_grad()
        # Saving gathers the shards into the unsharded optimizer's state, bit for bit.
        gathered, whole = opt.full_state_dict(), ref.state_dict()
        assert gathered["step_count"] == whole["step_count"] and gathered["params"].keys() == whole["params"].keys()
        for name, entry in whole["params"].items():
            assert entry.keys() == gathered["params"][name].keys(), name
            assert all(torch.equal(gathered["params"][name][k], t) for k, t in entry.items()), name
        # A replicated (whole) state loads into a sharded optimizer as its owned ranges.
        opt.load_state_dict(whole)
        for name, entry in opt.state_dict()["params"].items():
            start, stop = opt.inner._slots[[s.name for s in opt.inner._slots].index(name)].index
            assert torch.equal(entry["exp_avg_sq"], whole["params"][name]["exp_avg_sq"].reshape(-1)[start:stop])
        # A non-finite gradient on one replica only: both see a non-finite norm (found_inf agrees).
        _set_grads(named, rank, 9)
        if rank == 1:
            named[-1][1].grad.view(-1)[-1] = float("inf")
        opt.reduce_gradients()
        assert not torch.isfinite(opt.grad_sq_norm())
        opt.zero_grad()

def _check_all(rank: int) -> None:
    for dtype, exact in ((torch.float32, False), (torch.float32, True), (torch.bfloat16, True), (torch.float16, True)):
        _check(rank, dtype, exact)


def test_sharded_step_rollback_and_overlapped_gather_equal_the_unsharded_optimizer() -> None:
    run_on_two_gloo_ranks(_check_all)


def _check_tp_norm(rank: int) -> None:
    """Two TP ranks, one DP replica each: the sharded weight's squares summed over TP, the
    replicated ones (here deliberately one ulp apart between the ranks) counted once, from TP
    rank 0: both ranks get the same bits; an overflow in rank 1's replicated copy reaches both."""
    import torch.distributed as dist

    from megatron.pipeline.runtime.distributed_optimizer import DataParallelShardedOptimizer, data_parallel_shards
    from megatron.trainer.optim.adamw import StageAdamW

    own_dp = [dist.new_group([r]) for r in range(2)][rank]
    named = _named(torch.float32)
    named[0][1].tensor_model_parallel = True  # a.weight: this rank's TP shard
    opt = DataParallelShardedOptimizer(StageAdamW(named, lr=1e-2, weight_decay=0.0,
                                                  shards=data_parallel_shards(named, 1, 0)), 0, 1)
    opt.attach(own_dp, TIMEOUT)
    _set_grads(named, 0, 0)  # the same on both ranks...
    named[0][1].grad.mul_(rank + 1)  # ...but the shards differ
    if rank == 1:  # and rank 1's replicated copy is one ulp off
        named[1][1].grad.copy_(torch.nextafter(named[1][1].grad, torch.full_like(named[1][1].grad, 9.0)))
    sharded = named[0][1].grad.double().square().sum()
    replicated = sum(p.grad.double().square().sum() for _, p in named[1:])
    total = opt.tp_grad_sq_norm(dist.group.WORLD)
    both = [torch.zeros((), dtype=torch.float64) for _ in range(2)]
    dist.all_gather(both, total)
    assert torch.equal(both[0], both[1])
    if rank == 0:  # shards: 1x and 2x the same values -> 5x the one sum
        assert float(total) == pytest.approx(5 * float(sharded) + float(replicated), rel=1e-12)
    if rank == 1:
        named[-1][1].grad.view(-1)[0] = float("inf")
    assert not torch.isfinite(opt.tp_grad_sq_norm(dist.group.WORLD))


def test_tensor_parallel_norm_of_shards_counts_replicated_once_and_agrees_bitwise() -> None:
    run_on_two_gloo_ranks(_check_tp_norm)


# ------------------------------------------------------------------------------ end to end

NO_DROPOUT = ("--hidden-dropout", "0", "--attention-dropout", "0")


def _dp2(schedule: str, *extra: str, iters: int = 3) -> list[str]:
    return [*tiny_args(2, schedule, 2, iters, *NO_DROPOUT, *extra), "--data-parallel-size", "2",
            "--global-batch-size", "4"]


def _assert_close(got, want, exact: bool) -> None:
    (got_records, got_params), (want_records, want_params) = got, want
    assert [r["iteration"] for r in got_records] == [r["iteration"] for r in want_records]
    assert [r.get("skipped_updates") for r in got_records] == [r.get("skipped_updates") for r in want_records]
    for g, w in zip(got_records, want_records):
        assert g["loss"] == w["loss"] if exact else g["loss"] == pytest.approx(w["loss"], rel=1e-6)
    assert got_params.keys() == want_params.keys()
    for name, value in want_params.items():
        if exact:
            assert torch.equal(got_params[name], value), name
        else:
            rel = ((got_params[name] - value).norm() / value.norm()).item()
            assert rel <= 1e-6, f"{name}: relative difference {rel:.3e}"


@pytest.mark.slow
def test_1f1b_distributed_optimizer_equals_replicated_and_overlap_is_bitwise(tmp_path: Path) -> None:
    args = _dp2("1f1b")
    plain = run_pretrain(args, tmp_path / "plain")
    sharded = run_pretrain([*args, "--use-distributed-optimizer"], tmp_path / "sharded")
    overlapped = run_pretrain([*args, "--use-distributed-optimizer", "--overlap-param-gather"], tmp_path / "over")
    _assert_close(sharded, plain, exact=False)
    _assert_close(overlapped, sharded, exact=True)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,extra", [
    ("paci", ()),  # stage-local steps: each stage gathers on its own clock
    # stage 1's gradients turn non-finite at update 1: stage 0 stepped optimistically and rolls back
    ("1f1b", ("--enable-optimizer-post-validation", "--inject-nonfinite-grad", "1:1")),
], ids=["paci", "post-validation-rollback"])
def test_distributed_optimizer_equals_replicated(tmp_path: Path, schedule: str, extra: tuple[str, ...]) -> None:
    args = _dp2(schedule, *extra)
    plain = run_pretrain(args, tmp_path / "plain")
    sharded = run_pretrain([*args, "--use-distributed-optimizer", "--overlap-param-gather"], tmp_path / "sharded")
    if "--inject-nonfinite-grad" in extra:
        assert plain[0][1]["skipped_updates"] == [1, 1]
    _assert_close(sharded, plain, exact=False)


@pytest.mark.slow
def test_sharded_checkpoint_resumes_bitwise_and_reshards(tmp_path: Path) -> None:
    """The distributed optimizer saves its state gathered (a plain, whole state): the same layout
    resumes bitwise, and the checkpoint loads with its optimizer state into one replica without
    the flag (the emulator): the next losses equal the uninterrupted run's within fp rounding
    (the two replicas' gradient average is the only difference)."""
    args = [*tiny_args(1, "1f1b", 2, 4, *NO_DROPOUT), "--data-parallel-size", "2", "--global-batch-size", "4",
            "--use-distributed-optimizer", "--bf16"]
    save = tmp_path / "ckpt"
    full = run_pretrain(args, tmp_path / "full")
    run_pretrain([*args, "--save", str(save), "--exit-interval", "2"], tmp_path / "first")
    resumed = run_pretrain([*args, "--load", str(save)], tmp_path / "resumed")
    assert [r["iteration"] for r in resumed[0]] == [3, 4]
    _assert_close((resumed[0], resumed[1]), (full[0][2:], full[1]), exact=True)
    index = json.loads((save / "iter_0000002" / "metadata.json").read_text())["index"]
    assert index and not any(entry["optimizer_sharded"] for entry in index.values())
    state = torch.load(save / "iter_0000002" / "stage00_dp1.pt")["optimizer"]
    assert "data_parallel_shard" not in state
    for name, value in full[1].items():  # every entry whole, in parameter shape
        if name in state["params"]:
            assert state["params"][name]["exp_avg"].shape == value.shape, name
    single = [a for a in args if a not in ("--use-distributed-optimizer",)]
    single[single.index("--data-parallel-size") + 1] = "1"
    emulated = run_pretrain([*single, "--load", str(save), "--pipeline-executor", "emulator"], tmp_path / "dp1")
    assert [r["iteration"] for r in emulated[0]] == [3, 4]
    assert [r["loss"] for r in emulated[0]] == pytest.approx([r["loss"] for r in full[0][2:]], rel=1e-2)
    # Without the optimizer state (a fresh Adam at step 2) the weights land much further away:
    # the loaded moments and masters are what keep the resharded run on the saved run's path.
    fresh = run_pretrain([*single, "--load", str(save), "--pipeline-executor", "emulator", "--no-load-optim"],
                         tmp_path / "fresh")

    def distance(params: dict[str, torch.Tensor]) -> float:
        return max(float((params[k].float() - v.float()).abs().max()) for k, v in full[1].items())

    print(f"max |weights - uninterrupted|: loaded {distance(emulated[1]):.3e}, fresh optimizer {distance(fresh[1]):.3e}")
    assert distance(emulated[1]) * 10 < distance(fresh[1])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_nccl_reduce_scatter_and_overlapped_gather_equal_replicated(tmp_path: Path, monkeypatch) -> None:
    """DP=2 over NCCL (docs/gpu.md): reduce_scatter_tensor, the shard norm's all-reduce and the
    asynchronous all_gather_into_tensor on CUDA tensors train like the replicated optimizer."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    args = [*tiny_args(1, "1f1b", 2, 3, *NO_DROPOUT), "--data-parallel-size", "2", "--global-batch-size", "4",
            "--device", "cuda", "--distributed-backend", "nccl", "--pipeline-timeout-seconds", "60"]
    plain = run_pretrain(args, tmp_path / "plain", timeout=600)
    sharded = run_pretrain([*args, "--use-distributed-optimizer", "--overlap-param-gather"], tmp_path / "sharded",
                           timeout=600)
    # Not bitwise on a GPU: without torch's deterministic algorithms two runs may reduce in
    # other orders (docs/gpu.md section 7); a wrong shard or a stale gather is a whole step off.
    assert [r["loss"] for r in sharded[0]] == pytest.approx([r["loss"] for r in plain[0]], rel=1e-4)
    for name, value in plain[1].items():
        torch.testing.assert_close(sharded[1][name], value, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("argv,fragment", [
    (["--overlap-param-gather"], "needs the distributed optimizer"),
    (["--use-distributed-optimizer", "--optimizer", "basis-rotation"], "basis rotation rotates whole matrices"),
])
def test_refusals_are_one_line(capsys, argv: list[str], fragment: str) -> None:
    assert_flag_error(capsys, argv, fragment)
