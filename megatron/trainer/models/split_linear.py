"""megatron-core linears whose backward can defer the weight gradient (Zero Bubble's B / W).

:class:`SplitColumnParallelLinear` and :class:`SplitRowParallelLinear` subclass megatron's
``ColumnParallelLinear`` / ``RowParallelLinear``: same constructor, same parameters
(``weight``, ``bias``), same state dict and sharding, same ``(output, bias)`` return. Only
the matmul's autograd function is ours.

* Normally (deferral off) its backward is megatron's fused one, operation for operation:
  ``dx = dy @ W``, ``dW = dy2ᵀ @ x2``, ``db = dy2.sum(0)`` with ``dy2``, ``x2`` the contiguous
  2-D views megatron uses, so results are bitwise those of megatron's local linears.
* Inside :func:`megatron.pipeline.runtime.wgrad.defer_weight_grads` (op B) it returns ``dx`` only and
  records ``(x, dy)`` for W. Running that record (op W, or megatron's ``backward_dw()``)
  computes ``dW`` and ``db`` with the same operations on the same tensors and accumulates
  them into ``.grad`` the way autograd's ``AccumulateGrad`` does (assign if None, else
  in-place add). B then W therefore gives bitwise the gradients of the fused backward; across
  micro-batches only the order of the per-micro-batch additions can differ, and two
  contributions commute exactly.

What W keeps alive per linear and micro-batch: the layer input ``x`` (which the forward saved
anyway) and the output gradient ``dy``; everything else autograd saved is freed at the end
of B. For a GPT layer that is ``x``: 7·sbh and ``dy``: 9·sbh elements (qkv, proj, fc1, fc2,
with ffn = 4h), i.e. the paper's M_W = 32·sbh bytes in 16-bit.

Tensor parallelism: a column-parallel linear at TP > 1 (megatron's ``allreduce_dgrad``)
all-reduces ``dx`` over its TP group in its backward, i.e. in B, and W stays local (each
rank's ``dW`` is the gradient of its own shard: no communication). A row-parallel linear
needs nothing here (its output all-reduce is outside the matmul, in the forward). With
``--sequence-parallel`` a column-parallel linear's input is a sequence shard: the forward
all-gathers it (the matmul and W see the whole sequence) and B reduce-scatters ``dx`` instead
of all-reducing it; a row-parallel linear's reduce-scatter is again outside the matmul.

Not deferred (computed in B as before): biases added outside the matmul (megatron's
``skip_bias_add`` biases, which the layer adds in its bias-dropout-add / activation), and
every configuration this function does not implement -- frozen weights,
gradient-accumulation fusion, megatron's embedding-wgrad buffers, a non-leaf ``weight``
argument: those fall back to megatron's own path, which is correct but computes the weight
gradient in B.

Deferred gradients are written to ``.grad`` directly, so post-accumulate-grad hooks (torch
DDP, megatron DDP) do not fire for them; our runtime reduces data-parallel gradients at the
optimizer step instead.
"""
from __future__ import annotations

import copy
import dataclasses
from collections import deque
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

from megatron.pipeline.runtime.wgrad import accumulate_grad, active_deferral
from megatron.trainer.models.sequence_collectives import gather_first_dim, reduce_scatter_first_dim


def _weight_and_bias_grads(
    x: torch.Tensor, dy: torch.Tensor, use_bias: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``dW = dyᵀ x`` and ``db = Σ dy`` exactly as megatron's fused backward computes them."""
    dy2, x2 = prepare_input_tensors_for_wgrad_compute(dy, x)
    grad_weight = dy2.t().matmul(x2)
    grad_bias = dy2.sum(dim=0) if use_bias else None
    return grad_weight, grad_bias


class _LinearWeightGrad:
    """The deferred ``dW`` (and ``db``) of one linear for one backward."""

    __slots__ = ("module", "weight", "bias", "x", "dy", "versions", "done")

    def __init__(self, module: "_DeferrableWeightGrad", weight: torch.Tensor,
                 bias: torch.Tensor | None, x: torch.Tensor, dy: torch.Tensor):
        self.module = module
        self.weight = weight
        self.bias = bias
        self.x: torch.Tensor | None = x
        self.dy: torch.Tensor | None = dy
        # Autograd's saved-tensor check, which no longer guards x once B freed the graph.
        self.versions = (x._version, dy._version)
        self.done = False

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return () if self.done else (self.x, self.dy)  # type: ignore[return-value]

    def run(self) -> None:
        if self.done:
            return
        if (self.x._version, self.dy._version) != self.versions:
            raise RuntimeError(
                f"{type(self.module).__name__}: an input or output gradient kept for the deferred "
                "weight gradient was modified in place between B and W"
            )
        self.done = True
        self.module._wgrad_fifo.remove(self)
        grad_weight, grad_bias = _weight_and_bias_grads(self.x, self.dy, self.bias is not None)
        accumulate_grad(self.weight, grad_weight)
        if self.bias is not None:
            accumulate_grad(self.bias, grad_bias)
        self.x = self.dy = None  # free what W held


class _DeferrableLinearFunction(torch.autograd.Function):
    """``y = x Wᵀ (+ b)``; backward defers ``dW``/``db`` when a deferral store is active."""

    @staticmethod
    def forward(ctx, x, weight, bias, module, dgrad_group, sp_group=None):  # type: ignore[override]
        # --sequence-parallel (column-parallel): x is this rank's sequence shard; the matmul
        # (and W) takes the whole sequence, dx is reduce-scattered back to the shard in B.
        ctx.sp_group = sp_group
        if sp_group is not None:
            x = gather_first_dim(x, sp_group)
        ctx.save_for_backward(x, weight)
        # Column-parallel at TP > 1: the TP group dx is all-reduced over (in B), else None.
        ctx.dgrad_group = dgrad_group
        # Where deferred gradients accumulate: leaf parameters (checked by the caller).
        ctx.weight_param, ctx.bias = weight, bias
        ctx.module = module
        output = torch.matmul(x, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        bias = ctx.bias
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        if grad_input is not None and ctx.dgrad_group is not None:
            torch.distributed.all_reduce(grad_input, group=ctx.dgrad_group)
        if grad_input is not None and ctx.sp_group is not None:
            grad_input = reduce_scatter_first_dim(grad_input, ctx.sp_group)
        store = active_deferral()
        if store is not None:
            # Detached: the saved input still points into the graph (its grad_fn, and through it the
            # stage input's AccumulateGrad with that input and its .grad), which B is done with.
            work = _LinearWeightGrad(ctx.module, ctx.weight_param, bias, x.detach(), grad_output.detach())
            ctx.module._wgrad_fifo.append(work)
            store.add(work)
            return grad_input, None, None, None, None, None
        grad_weight, grad_bias = _weight_and_bias_grads(x, grad_output, bias is not None)
        return grad_input, grad_weight, grad_bias, None, None, None


_FALLBACK_FLAGS = ("gradient_accumulation_fusion",)


class _DeferrableWeightGrad:
    """Mixin over megatron's linears: our autograd function plus megatron's ``backward_dw``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Deferred work of this layer not yet run, oldest first (megatron's backward_dw order).
        self._wgrad_fifo: deque[_LinearWeightGrad] = deque()

    def _deferrable(self, weight: torch.Tensor, args: tuple, kwargs: dict[str, Any]) -> bool:
        if args or not weight.requires_grad or not weight.is_leaf:
            return False
        if any(kwargs.get(flag) for flag in _FALLBACK_FLAGS):
            return False
        if (kwargs.get("allreduce_dgrad") or kwargs.get("sequence_parallel")) and kwargs.get("tp_group") is None:
            return False  # megatron would all-reduce over the default group: leave it to it
        if kwargs.get("grad_output_buffer") is not None:
            return False
        bias = kwargs.get("bias")
        return bias is None or bias.is_leaf

    def _forward_impl(self, input, weight, *args, **kwargs):  # noqa: A002 - megatron's name
        if not self._deferrable(weight, args, kwargs):
            return super()._forward_impl(input, weight, *args, **kwargs)  # type: ignore[misc]
        dgrad_group = kwargs["tp_group"] if kwargs.get("allreduce_dgrad") else None
        sp_group = kwargs["tp_group"] if kwargs.get("sequence_parallel") else None
        return _DeferrableLinearFunction.apply(input, weight, kwargs.get("bias"), self, dgrad_group, sp_group)

    def backward_dw(self) -> None:
        """megatron's API: run the oldest deferred weight gradient of this layer (if any)."""
        if self._wgrad_fifo:
            self._wgrad_fifo[0].run()

    @property
    def num_deferred_wgrads(self) -> int:
        return len(self._wgrad_fifo)


class SplitColumnParallelLinear(_DeferrableWeightGrad, ColumnParallelLinear):
    """``ColumnParallelLinear`` whose weight gradient can be deferred to W (any TP size)."""


class SplitRowParallelLinear(_DeferrableWeightGrad, RowParallelLinear):
    """``RowParallelLinear`` whose weight gradient can be deferred to W (any TP size)."""


_REPLACEMENTS: dict[type, type] = {
    ColumnParallelLinear: SplitColumnParallelLinear,
    RowParallelLinear: SplitRowParallelLinear,
}


def _replace(value: Any) -> Any:
    if isinstance(value, type):
        return _REPLACEMENTS.get(value, value)
    if isinstance(value, ModuleSpec):
        if isinstance(value.module, type):
            value.module = _REPLACEMENTS.get(value.module, value.module)
        _replace_fields(value.submodules)
    return value


def _replace_fields(submodules: Any) -> None:
    if submodules is None or not dataclasses.is_dataclass(submodules) or isinstance(submodules, type):
        return
    for f in dataclasses.fields(submodules):
        setattr(submodules, f.name, _replace(getattr(submodules, f.name)))


def with_split_linears(spec: ModuleSpec) -> ModuleSpec:
    """A copy of a local-backend layer spec with megatron's (exact) ``ColumnParallelLinear`` /
    ``RowParallelLinear`` replaced by the split ones, wherever they occur in the tree.

    Subclasses and other backends' linears (Transformer Engine) are left alone.
    """
    spec = copy.deepcopy(spec)
    _replace(spec)
    return spec
