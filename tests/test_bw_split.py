"""The B/W split (Zero Bubble): split linears, a split GPT stage, and B/W schedules end to end.

B computes input gradients only (weight gradients of the split linears are queued), W computes
the queued weight gradients. The claim checked here is exactness: per micro-batch, B then W
performs the very operations of the fused backward on the very tensors, and accumulates the
same way autograd does, so gradients are bitwise equal; only the order in which different
micro-batches' contributions are added can change, and for two contributions that is exact too
(floating-point addition commutes). A schedule whose Ws follow its Bs' order trains bitwise
like its fused counterpart.
"""
from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator

import pytest
import torch

from megatron.pipeline.ir import B, F, W, Op, OpKind, PipelineLayout
from megatron.pipeline.schedules import SCHEDULES, register
from megatron.pipeline.schedules.base import SynchronousSchedule, one_f_one_b
from megatron.pipeline.schedule_check import check_schedule
from megatron.pipeline.runtime.wgrad import active_deferral, defer_weight_grads
from megatron.trainer.data import MockGPTData
from megatron.trainer.models.gpt import GPTModelArgs, build_gpt_stage, gpt_loss, split_layers
from tests.async_helpers import emulate, final_params, tiny_args

pytestmark = pytest.mark.usefixtures("megatron_world1")

TINY = GPTModelArgs(
    num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
    max_position_embeddings=16, vocab_size=128,
)


# --------------------------------------------------------------------------- one linear


def _config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
        cuda_graph_scope=[], gradient_accumulation_fusion=False,
    )


def _linear(cls, skip_bias_add: bool, seed: int = 0):
    """A 8 -> 12 linear of ``cls`` with random (non-zero) weight and bias."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    extra = {"input_is_parallel": True} if issubclass(cls, RowParallelLinear) else {}
    layer = cls(8, 12, config=_config(), init_method=torch.nn.init.zeros_, bias=True,
                skip_bias_add=skip_bias_add, **extra)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=g))
        layer.bias.copy_(torch.randn(layer.bias.shape, generator=g))
    return layer


def _step(layer, x, dy):
    """Forward the linear (adding a skipped bias like megatron's layers do) and backprop ``dy``."""
    y, bias = layer(x)
    if bias is not None:
        y = y + bias
    y.backward(dy)


def _linear_kinds():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron.trainer.models.split_linear import SplitColumnParallelLinear, SplitRowParallelLinear

    return [
        pytest.param(ColumnParallelLinear, SplitColumnParallelLinear, False, id="column-bias-inside"),
        pytest.param(ColumnParallelLinear, SplitColumnParallelLinear, True, id="column-skip-bias-add"),
        pytest.param(RowParallelLinear, SplitRowParallelLinear, False, id="row"),
        pytest.param(RowParallelLinear, SplitRowParallelLinear, True, id="row-skip-bias-add"),
    ]


def _inputs(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 3, 8, generator=g), torch.randn(5, 3, 12, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("megatron_cls,split_cls,skip_bias_add", _linear_kinds())
def test_split_linear_fused_mode_is_megatrons_linear_bitwise(megatron_cls, split_cls, skip_bias_add):
    (x0, dy), = _inputs(1)
    results = []
    for cls in (megatron_cls, split_cls):
        layer = _linear(cls, skip_bias_add)
        x = x0.clone().requires_grad_(True)
        out, out_bias = layer(x)
        assert (out_bias is None) == (not skip_bias_add)
        (out if out_bias is None else out + out_bias).backward(dy)
        results.append((out.detach(), x.grad, layer.weight.grad, layer.bias.grad))
        assert {n for n, _ in layer.named_parameters()} == {"weight", "bias"}
        assert set(layer.state_dict()) == {"weight", "bias", "_extra_state"}
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("megatron_cls,split_cls,skip_bias_add", _linear_kinds())
@pytest.mark.parametrize("via", ["store", "backward_dw"])
def test_split_linear_b_then_w_equals_fused(megatron_cls, split_cls, skip_bias_add, via):
    """dX from B, then dW / db from W (two micro-batches, Ws in reverse order): bitwise fused."""
    fused, split = _linear(split_cls, skip_bias_add), _linear(split_cls, skip_bias_add)
    mbs = _inputs(2)
    fused_dx = []
    for x0, dy in mbs:
        x = x0.clone().requires_grad_(True)
        _step(fused, x, dy)
        fused_dx.append(x.grad)

    stores = []
    for (x0, dy), ref_dx in zip(mbs, fused_dx):
        x = x0.clone().requires_grad_(True)
        y, bias = split(x)
        with defer_weight_grads() as store:
            (y if bias is None else y + bias).backward(dy)
        assert active_deferral() is None
        assert torch.equal(x.grad, ref_dx)  # B: the input gradient, exactly
        assert split.weight.grad is None and len(store) == 1
        # A bias added outside the matmul (skip_bias_add, or the row linear's own add) gets
        # its gradient from autograd in B; a bias inside the matmul is deferred with dW.
        bias_in_b = skip_bias_add or megatron_cls.__name__ == "RowParallelLinear"
        assert (split.bias.grad is not None) == bias_in_b
        stores.append(store)
    assert split.num_deferred_wgrads == 2
    if via == "store":
        stores[1].run()
        stores[0].run()
    else:
        split.backward_dw()
        split.backward_dw()
        assert all(not s.tensors() for s in stores)  # megatron's API consumed the same work
        for s in stores:
            s.run()  # already done: a no-op
    assert split.num_deferred_wgrads == 0
    assert torch.equal(split.weight.grad, fused.weight.grad)
    assert torch.equal(split.bias.grad, fused.bias.grad)


def test_split_linear_holds_x_and_dy_until_w():
    from megatron.trainer.models.split_linear import SplitColumnParallelLinear

    layer = _linear(SplitColumnParallelLinear, False)
    (x0, dy), = _inputs(1)
    x = x0.clone().requires_grad_(True)
    y, _ = layer(x)
    with defer_weight_grads() as store:
        y.backward(dy)
    held = store.tensors()
    assert [t.shape for t in held] == [x.shape, dy.shape]
    # The input the forward saved anyway (same storage), not a copy.
    assert held[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    store.run()
    assert store.tensors() == [] and len(store) == 0


def test_in_place_change_between_b_and_w_is_caught():
    from megatron.trainer.models.split_linear import SplitRowParallelLinear

    layer = _linear(SplitRowParallelLinear, False)
    (x0, dy), = _inputs(1)
    x = x0.clone().requires_grad_(True)
    y, _ = layer(x)
    with defer_weight_grads() as store:
        y.backward(dy)
    with torch.no_grad():
        x.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified in place between B and W"):
        store.run()


def test_frozen_weight_falls_back_to_megatron():
    from megatron.trainer.models.split_linear import SplitColumnParallelLinear

    layer = _linear(SplitColumnParallelLinear, False)
    layer.weight.requires_grad_(False)
    layer.bias.requires_grad_(False)
    (x0, dy), = _inputs(1)
    x = x0.clone().requires_grad_(True)
    y, _ = layer(x)
    with defer_weight_grads() as store:
        y.backward(dy)
    assert len(store) == 0 and x.grad is not None


# --------------------------------------------------------------------------- GPT stages


def _stages(counts: list[int]):
    ranges = split_layers(TINY.num_layers, len(counts), counts)
    return [
        build_gpt_stage(TINY, r, i == 0, i == len(ranges) - 1, seed=1234, device="cpu")
        for i, r in enumerate(ranges)
    ]


def _batch(mb: int):
    return MockGPTData(TINY.seq_length, TINY.vocab_size, seed=7).micro_batch([2 * mb, 2 * mb + 1])


def test_gpt_layer_spec_uses_split_linears_only_in_layers():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from megatron.trainer.models.split_linear import SplitColumnParallelLinear, SplitRowParallelLinear

    (stage,) = _stages([4])
    for layer in stage.model.decoder.layers:
        assert type(layer.self_attention.linear_qkv) is SplitColumnParallelLinear
        assert type(layer.self_attention.linear_proj) is SplitRowParallelLinear
        assert type(layer.mlp.linear_fc1) is SplitColumnParallelLinear
        assert type(layer.mlp.linear_fc2) is SplitRowParallelLinear
    assert type(stage.model.output_layer) is ColumnParallelLinear  # stays in B


def _run_stages(stages, microbatches, split: bool, w_order=None, via_megatron_api=False):
    """Forward / backward ``microbatches`` through hand-composed stages, the way the runtime
    does (detached boundaries); in split mode every stage's backward is a B and the Ws run
    afterwards in ``w_order``. Returns per-parameter grads and each first-stage-input grad."""
    stores: dict[tuple[int, int], object] = {}
    boundary_grads = []
    for mb in microbatches:
        batch = _batch(mb)
        inputs, outputs, x = [], [], None
        for stage in stages:
            if x is not None:
                x = x.detach().requires_grad_(True)
            inputs.append(x)
            out = stage(x, batch)
            outputs.append(out)
            x = out
        grad = None
        for k in range(len(stages) - 1, -1, -1):
            target = gpt_loss(outputs[k], batch)[0] if k == len(stages) - 1 else outputs[k]
            if split:
                with defer_weight_grads() as store:
                    target.backward(grad)
                stores[(mb, k)] = store
            else:
                target.backward(grad)
            grad = inputs[k].grad if k > 0 else None
            if k > 0:
                boundary_grads.append(grad.clone())
    if split and via_megatron_api:  # megatron's own Attention / MLP.backward_dw(): FIFO per layer
        for _ in microbatches:
            for stage in stages:
                for layer in stage.model.decoder.layers:
                    layer.self_attention.backward_dw()
                    layer.mlp.backward_dw()
        assert all(not s.tensors() for s in stores.values())
    elif split:
        for mb in w_order:
            for k in range(len(stages)):
                stores[(mb, k)].run()
    grads = {n: p.grad.clone() for s in stages for n, p in s.global_named_parameters()}
    return grads, boundary_grads


@pytest.mark.parametrize("counts", [[4], [1, 2, 1]], ids=["1-stage", "3-stages"])
@pytest.mark.parametrize("w_order", ["same", "reversed", "megatron-api"])
def test_gpt_stage_b_then_w_equals_fused_backward(counts, w_order):
    mbs = [0, 1]
    ref_grads, ref_boundary = _run_stages(_stages(counts), mbs, split=False)
    order = {"same": mbs, "reversed": mbs[::-1], "megatron-api": None}[w_order]
    grads, boundary = _run_stages(
        _stages(counts), mbs, split=True, w_order=order, via_megatron_api=w_order == "megatron-api"
    )
    for a, b in zip(boundary, ref_boundary):
        assert torch.equal(a, b)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-6, atol=0, msg=name)
        assert torch.equal(grad, ref_grads[name]), name  # in fact bitwise


def test_gpt_stage_b_defers_exactly_the_layer_linears():
    (stage,) = _stages([4])
    batch = _batch(0)
    loss, _ = gpt_loss(stage(None, batch), batch)
    with defer_weight_grads() as store:
        loss.backward()
    assert len(store) == 4 * TINY.num_layers
    deferred = {n for n, p in stage.global_named_parameters() if p.grad is None}
    expected = {
        f"decoder.layers.{i}.{m}.{p}"
        for i in range(TINY.num_layers)
        for m in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
        for p in ("weight",)
    } | {f"decoder.layers.{i}.self_attention.linear_qkv.bias" for i in range(TINY.num_layers)}
    assert deferred == expected
    store.run()
    assert all(p.grad is not None for p in stage.parameters())


# --------------------------------------------------------------------------- worker


def _worker(chunk: torch.nn.Module, loss_fn, layout=PipelineLayout(1), stage=0):
    from megatron.pipeline.runtime.worker import StageSetup, StageWorker
    from megatron.trainer.optim.lr_schedule import LRSchedule
    from megatron.trainer.optim.adamw import StageAdamW

    setup = StageSetup(
        stage=stage, layout=layout, chunks=[chunk],
        optimizer=StageAdamW(list(chunk.named_parameters()), lr=1e-3, weight_decay=0.0),
        lr_schedule=LRSchedule(max_lr=1e-3, min_lr=0.0, warmup_steps=0, decay_steps=10, decay_style="constant"),
        microbatches_per_update=2, batch_fn=_batch, loss_fn=loss_fn,
        activation_shape=(TINY.seq_length, 2, TINY.hidden_size), activation_dtype=torch.float32,
        device=torch.device("cpu"), measure_activations=True,
    )
    return StageWorker(setup, isolate_rng=True)


def test_worker_b_w_memory_accounting_and_grads():
    (fused_stage,), (split_stage,) = _stages([4]), _stages([4])
    fused, split = _worker(fused_stage, gpt_loss), _worker(split_stage, gpt_loss)
    for mb in (0, 1):
        fused.forward(F(0, mb), None)
        split.forward(F(0, mb), None)
    full = split.meter.peak_bytes
    assert split.meter.live_count == 2
    for mb in (0, 1):
        fused.backward(Op(OpKind.BW, 0, mb), None)
        assert split.backward_input(B(0, mb), None) is None
    # After B a micro-batch holds only what W needs: less than its forward saved, not nothing.
    assert split.meter.live_count == 2
    live_w = sum(split.meter._live.values())
    assert 0 < live_w < full
    assert sum(split.drift_histogram.values()) == 2  # drift is recorded at B
    with pytest.raises(RuntimeError, match="still deferred"):
        split.grad_sq_norm(Op(OpKind.OPT, 0, update=0, sync=True))
    split.weight_grad(W(0, 1))
    split.weight_grad(W(0, 0))
    assert split.meter.live_count == 0
    with pytest.raises(RuntimeError, match="no preceding B"):
        split.weight_grad(W(0, 0))
    for (name, p), (_, q) in zip(fused_stage.global_named_parameters(), split_stage.global_named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert split.grad_sq_norm(Op(OpKind.OPT, 0, update=0, sync=True)) == fused.grad_sq_norm(
        Op(OpKind.OPT, 0, update=0, sync=True))


class _PlainStage(torch.nn.Module):
    """A stage model without split linears: B must compute every gradient, W nothing."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(TINY.hidden_size, 64), torch.nn.GELU(),
                                       torch.nn.Linear(64, TINY.hidden_size))

    def forward(self, x, batch):
        return self.net(x)


def _square_loss(out, batch):
    return out.square().mean(), 1


def test_worker_b_w_on_a_module_without_split_linears():
    # Stage 1 of 2: receives an activation, computes a loss and returns an input gradient.
    layout = PipelineLayout(2)
    plain_fused, plain_split = _PlainStage(), _PlainStage()
    fused = _worker(plain_fused, _square_loss, layout, stage=1)
    split = _worker(plain_split, _square_loss, layout, stage=1)
    x = torch.randn(TINY.seq_length, 2, TINY.hidden_size, generator=torch.Generator().manual_seed(3))
    fused.forward(F(1, 0), x)
    split.forward(F(1, 0), x)
    dx_fused = fused.backward(Op(OpKind.BW, 1, 0), None)
    dx_split = split.backward_input(B(1, 0), None)
    assert torch.equal(dx_fused, dx_split)
    assert split.meter.live_count == 0  # nothing held for W: released at B
    grads_after_b = [p.grad.clone() for p in plain_split.parameters()]
    split.weight_grad(W(1, 0))  # a no-op, but a valid op
    for p, q, g in zip(plain_fused.parameters(), plain_split.parameters(), grads_after_b):
        assert torch.equal(p.grad, q.grad) and torch.equal(q.grad, g)


# --------------------------------------------------------------------------- end to end


class _OneFOneBSplitBW(SynchronousSchedule):
    """Test-only: 1F1B with each BW split into B now and W after the stage's next forward."""

    name = "test-1f1b-split-bw"

    def iteration_ops(self, stage: int, microbatches: range) -> Iterator[Op]:
        pending: deque[int] = deque()
        for op in one_f_one_b(stage, self.config.num_stages, microbatches):
            if op.kind is OpKind.BW:
                yield B(stage, op.microbatch)
                pending.append(op.microbatch)
                continue
            yield op
            while pending:
                yield W(stage, pending.popleft())
        while pending:
            yield W(stage, pending.popleft())


@pytest.fixture
def split_schedule():
    register(_OneFOneBSplitBW)
    try:
        yield _OneFOneBSplitBW.name
    finally:
        SCHEDULES.pop(_OneFOneBSplitBW.name, None)


def test_test_schedule_is_valid_and_really_splits(split_schedule):
    from megatron.pipeline.schedules import ScheduleConfig, build_schedule

    for n in (1, 2, 4):
        schedule = build_schedule(split_schedule, ScheduleConfig(n, 8, 2))
        check_schedule(schedule)
        ops = list(schedule.stage_ops(0))
        kinds = [op.kind for op in ops]
        assert OpKind.BW not in kinds and kinds.count(OpKind.B) == kinds.count(OpKind.W) == 16
        # Some W runs after a later F than its B (deferred), not right behind it.
        assert any(a.kind is OpKind.B and b.kind is OpKind.F for a, b in zip(ops, ops[1:]))


def _losses(path):
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("num_stages", [2, 4])
def test_emulator_b_w_schedule_trains_like_1f1b(split_schedule, num_stages, tmp_path):
    iters = 10
    base = tiny_args(num_stages, "1f1b", 4, iters, "--pipeline-executor", "emulator",
                     "--clip-grad", "1.0", "--hidden-dropout", "0.1")
    ref_workers = emulate([*base, "--log-json", str(tmp_path / "ref.jsonl"), "--log-activation-memory"])
    split_args = [x if x != "1f1b" else split_schedule for x in base]
    split_workers = emulate([*split_args, "--log-json", str(tmp_path / "split.jsonl"), "--log-activation-memory"])

    ref_losses, split_losses = _losses(tmp_path / "ref.jsonl"), _losses(tmp_path / "split.jsonl")
    assert len(ref_losses) == len(split_losses) == iters
    for a, b in zip(split_losses, ref_losses):
        assert a == pytest.approx(b, rel=1e-6, abs=0)
    assert split_losses == ref_losses  # in fact bitwise
    ref, got = final_params(ref_workers), final_params(split_workers)
    assert ref.keys() == got.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=0, msg=name)
        assert torch.equal(got[name], ref[name]), name
    for w, r in zip(split_workers, ref_workers):
        assert w.drift_histogram == r.drift_histogram
        assert w.meter.live_count == 0 and not w._deferred
        # Held activations: Ws wait one forward, so micro-batches pending W overlap new ones;
        # their W part is smaller than a full activation set.
        assert w.meter.run_peak_bytes >= r.meter.run_peak_bytes
    # The last stage runs F B F W ...: a W part is held across the next forward, so W really
    # had deferred work (this would be equal if nothing were deferred).
    assert split_workers[-1].meter.run_peak_bytes > ref_workers[-1].meter.run_peak_bytes
