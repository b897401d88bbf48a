"""``--overlap-grad-reduce``: bucketed all-reduces launched inside the window's last backward.

Two layers of evidence:

* the mechanism, on two gloo processes with a small module and no trainer: buckets are launched
  from inside the last micro-batch's backward (not at the step; a do-nothing or at-the-step
  implementation fails), gradients finished outside autograd (W's deferred ones) launch when
  their op ends, a window the stage never completed is reduced at the step, a gradient op
  while buckets are in flight raises, and the averages equal one flat all-reduce bitwise;
* end to end, PP=2 x DP=2 on gloo: the overlapped run equals the non-overlapped one bitwise
  (losses and final parameters) for 1F1B, PACI (stage-local steps), ZB-H1 (B/W split: W
  finishes the gradients) and 1F1B with post-validation (PSTEP reduces before its partial step).
"""
from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch

from tests.async_helpers import run_pretrain, tiny_args
from tests.gloo_ranks import run_on_two_gloo_ranks

BUCKET = 10  # elements: every parameter of the module below ends a bucket


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _backward(module: torch.nn.Module, rank: int, mb: int) -> None:
    x = torch.arange(8, dtype=torch.float32).view(2, 4) * (rank + 1) + mb
    module(x).square().sum().backward()


def _flat_reference(rank: int, microbatches: int) -> list[torch.Tensor]:
    """Gradients of the same micro-batches, averaged by one flat all-reduce (the old path)."""
    import torch.distributed as dist

    module = _module()
    for mb in range(microbatches):
        _backward(module, rank, mb)
    flat = torch.cat([p.grad.reshape(-1) for p in module.parameters()])
    dist.all_reduce(flat)
    flat /= 2
    return list(flat.split([p.numel() for p in module.parameters()]))


def _check(rank: int) -> None:
    from megatron.pipeline.runtime.grad_buckets import OverlappedGradReduce

    timeout = datetime.timedelta(seconds=60)
    module = _module()
    params = list(module.parameters())
    sync = OverlappedGradReduce([params], BUCKET, None, 2, timeout)
    assert len(sync.buckets) > 2
    with sync.grad_op(0, 2, 0, completes=True):
        _backward(module, rank, 0)
    assert sync.launches == [], "launched before the window's last micro-batch"
    with sync.grad_op(0, 2, 0, completes=True):
        _backward(module, rank, 1)
        during = list(sync.launches)
    assert during and set(during) == {"backward"}, f"nothing launched inside the last backward: {during}"
    assert len(sync.launches) == len(sync.buckets) and "step" not in sync.launches
    with pytest.raises(RuntimeError, match="being reduced"):
        with sync.grad_op(1, 2, 0, completes=True):
            pass
    sync.finish()
    for p, ref in zip(params, _flat_reference(rank, 2)):
        assert torch.equal(p.grad, ref.view_as(p.grad))

    # W finishes gradients outside autograd (no hook fires): the buckets launch at the op's end.
    module.zero_grad(set_to_none=True)
    sync.launches.clear()
    with sync.grad_op(1, 2, 0, completes=False):  # B of both micro-batches: not final yet
        _backward(module, rank, 0)
        _backward(module, rank, 1)
    for _ in range(2):
        with sync.grad_op(1, 2, 0, completes=True):  # W: nothing left to accumulate here
            pass
    assert set(sync.launches) == {"op end"} and len(sync.launches) == len(sync.buckets)
    sync.finish()
    for p, ref in zip(params, _flat_reference(rank, 2)):
        assert torch.equal(p.grad, ref.view_as(p.grad))

    # A window this stage did not complete is reduced at the step, with the same numbers.
    module.zero_grad(set_to_none=True)
    sync.launches.clear()
    with sync.grad_op(2, 2, 0, completes=True):
        _backward(module, rank, 0)
    sync.finish()
    assert set(sync.launches) == {"step"}
    for p, ref in zip(params, _flat_reference(rank, 1)):
        assert torch.equal(p.grad, ref.view_as(p.grad))


def test_buckets_launch_inside_the_last_backward() -> None:
    run_on_two_gloo_ranks(_check)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,extra", [
    ("1f1b", ()),
    ("paci", ()),
    ("zb-h1", ()),
    ("1f1b", ("--enable-optimizer-post-validation",)),
])
def test_overlapped_equals_non_overlapped(tmp_path: Path, schedule: str, extra: tuple[str, ...]) -> None:
    args = [*tiny_args(2, schedule, 2, 2, "--hidden-dropout", "0", "--attention-dropout", "0", *extra),
            "--data-parallel-size", "2", "--global-batch-size", "4"]
    plain, p_plain = run_pretrain(args, tmp_path / "plain")
    # 300 elements: several buckets per stage of the tiny GPT.
    overlapped, p_over = run_pretrain([*args, "--overlap-grad-reduce", "--ddp-bucket-size", "300"], tmp_path / "over")
    assert [r["loss"] for r in overlapped] == [r["loss"] for r in plain]
    assert p_over.keys() == p_plain.keys()
    for name, value in p_plain.items():
        assert torch.equal(p_over[name], value), name
