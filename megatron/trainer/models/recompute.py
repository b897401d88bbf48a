"""Activation recompute for megatron-core stage models (Megatron-LM's ``--recompute-*``).

The stage's ``TransformerConfig`` carries Megatron's own settings (``recompute_granularity``,
``recompute_method``, ``recompute_num_layers``, ``recompute_modules``), so megatron-core
checks them and its ``TransformerBlock`` / ``Attention`` take their recompute branches with
Megatron's grouping. Only the checkpoint primitive is ours: megatron-core 0.16.1's
``tensor_parallel.checkpoint`` (``CheckpointFunction``) reads ``torch.cuda.get_rng_state()``
and fails on a CPU-only build ("Torch not compiled with CUDA enabled"), and it is reentrant.
:func:`install_recompute` therefore binds, on every block and attention module of a stage,
``_checkpointed_forward`` / ``_checkpointed_attention_forward`` implementations that run the
same layers through :func:`checkpoint`:

* ``torch.utils.checkpoint`` non-reentrant with ``preserve_rng_state=True``: the CPU RNG and the
  CUDA RNG of the inputs' devices are restored for the recomputation (dropout masks repeat)
  and put back afterwards (recompute draws nothing from the training stream);
* megatron's CUDA RNG tracker states (Transformer Engine's attention dropout forks it) are
  snapshot at the forward and restored around the recomputation the same way;
* recomputation happens when backward first needs a saved tensor of the region, i.e. once,
  inside the backward op (BW, or B of a split backward). The split linears' deferred weight
  gradients (``megatron.pipeline.runtime.wgrad``) keep the *recomputed* layer inputs for W,
  so W needs no second recompute.

The region's inputs are kept by the checkpoint itself, outside autograd's saved tensors;
:class:`_KeepVisible` passes them through a no-op autograd function that saves them, so
saved-tensor hooks (the runtime's activation meter) see what recompute really keeps.

Weights: the recomputation reads the parameters current at backward time. Synchronous
schedules never update between a micro-batch's F and B, so recompute changes nothing. Under
asynchronous schedules without weight stashing it does (docs/schedules.md), unless the weights
of the forward are stashed (``stash_weights``): each recomputed region then snapshots its
parameters at the forward (one copy per distinct version in flight) and swaps them in for the
recomputation only, so the backward is exactly the one without recompute.
"""
from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from megatron.trainer.config.choices import SELECTIVE_MODULES


@dataclass(frozen=True)
class RecomputeSettings:
    """Megatron-LM's recompute flags for one model (validated by ``recompute_args``)."""

    granularity: str | None = None  # None (off), "full" or "selective"
    method: str | None = None  # full: "uniform" or "block"
    num_layers: int | None = None  # full: layers per unit (uniform) / recomputed layers (block)
    stash_weights: bool = False  # full: recompute on the forward's weights (asynchronous schedules)

    def config_fields(self) -> dict[str, Any]:
        """The ``TransformerConfig`` fields of these settings."""
        if self.granularity is None:
            return {}
        fields: dict[str, Any] = {"recompute_granularity": self.granularity}
        if self.granularity == "full":
            fields.update(recompute_method=self.method, recompute_num_layers=self.num_layers)
        else:
            fields["recompute_modules"] = list(SELECTIVE_MODULES)
        return fields


def checkpointed_units(method: str, num_layers: int, n: int) -> list[tuple[int, int, bool]]:
    """Megatron's full-recompute plan of a block with ``n`` layers: ``(start, end, recompute)``
    units run in order. ``uniform``: every unit is ``num_layers`` layers, each recomputed as one
    (only its input kept); ``block``: the first ``num_layers`` layers recomputed one by one, the
    rest run normally."""
    if method == "uniform":
        if n % num_layers:
            raise ValueError(f"recompute_num_layers {num_layers} does not divide the block's {n} layers")
        return [(i, i + num_layers, True) for i in range(0, n, num_layers)]
    if method == "block":
        return [(i, i + 1, i < num_layers) for i in range(n)]
    raise ValueError(f"unknown recompute method {method!r}")


class _KeepVisible(torch.autograd.Function):
    """Identity whose forward saves its input: a checkpoint keeps its inputs alive by itself,
    and this makes them visible to saved-tensor hooks (memory meters, offloading)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


def _visible(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and torch.is_grad_enabled():
        return _KeepVisible.apply(x)
    return x


# ------------------------------------------------------------------------- weight stash


class _Snapshot:
    """One version of a region's parameters (weak-referenceable, shared by micro-batches)."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.values = [p.detach().clone() for p in params]


class _RegionWeights:
    """The parameters one checkpointed region reads, with snapshots of the versions in flight.

    A forward reuses the newest snapshot while the parameters still equal it (comparing is a
    read, copying would also be a write), so the copies held are one per distinct version
    with micro-batches in flight; each lives as long as some recomputation may still need it.
    """

    def __init__(self, params: Sequence[torch.Tensor]):
        self.params = list(params)
        self._newest: weakref.ref[_Snapshot] | None = None

    def snapshot(self) -> _Snapshot:
        newest = self._newest() if self._newest is not None else None
        if newest is not None and all(torch.equal(p, v) for p, v in zip(self.params, newest.values)):
            return newest
        newest = _Snapshot(self.params)
        self._newest = weakref.ref(newest)
        return newest

    @contextlib.contextmanager
    def swapped_in(self, snapshot: _Snapshot) -> Iterator[None]:
        """The snapshot's values in the parameters' storage for the block, then the current
        ones back (through ``.data``: no version counter moves, the saved graph stays valid)."""
        current = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, v in zip(self.params, snapshot.values):
                p.data.copy_(v)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, v in zip(self.params, current):
                    p.data.copy_(v)


# ------------------------------------------------------------------------- checkpoint


def _rng_tracker_contexts(weights: _RegionWeights | None) -> tuple[Any, Any]:
    """``context_fn`` of :func:`checkpoint`: snapshot megatron's CUDA RNG tracker (and the
    region's weights) at the forward, put them in place for the recomputation."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    saved: dict[str, Any] = {}

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        if tracker.is_initialized():
            saved["tracker"] = {k: v.clone() for k, v in tracker.get_states().items()}
        if weights is not None:
            saved["weights"] = weights.snapshot()
        yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if "tracker" in saved:
                outer = tracker.get_states()
                tracker.set_states({k: v.clone() for k, v in saved["tracker"].items()})
                stack.callback(tracker.set_states, outer)
            if "weights" in saved:
                stack.enter_context(weights.swapped_in(saved["weights"]))  # type: ignore[union-attr]
            yield

    return forward(), recompute()


def checkpoint(fn: Callable[..., Any], *args: Any, weights: _RegionWeights | None = None) -> Any:
    """``fn(*args)`` keeping only its inputs; recomputed once when backward needs its
    activations, with the forward's RNG states (and, with ``weights``, its parameters)."""
    args = tuple(_visible(a) for a in args)
    return torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=False, preserve_rng_state=True,
        context_fn=lambda: _rng_tracker_contexts(weights))


# ------------------------------------------------------------------------- megatron hooks


def _block_checkpointed_forward(block: Any, hidden_states: torch.Tensor, attention_mask: Any, context: Any,
                                context_mask: Any, rotary_pos_emb: Any, attention_bias: Any,
                                packed_seq_params: Any, use_inner_quantization_context: bool = False,
                                padding_mask: Any = None) -> torch.Tensor:
    """``TransformerBlock._checkpointed_forward`` (full recompute) on :func:`checkpoint`."""
    if use_inner_quantization_context:
        raise NotImplementedError("full recompute with fp8/fp4 layers is not supported")
    config = block.config

    def run(start: int, end: int) -> Callable[..., Any]:
        def forward(hidden: torch.Tensor, ctx: Any) -> tuple[torch.Tensor, Any]:
            for index in range(start, end):
                hidden, ctx = block.layers[index](
                    hidden_states=hidden, attention_mask=attention_mask, context=ctx,
                    context_mask=context_mask, rotary_pos_emb=rotary_pos_emb, attention_bias=attention_bias,
                    inference_context=None, packed_seq_params=packed_seq_params, padding_mask=padding_mask)
            return hidden, ctx
        return forward

    stash = block._recompute_stash
    for start, end, recompute in checkpointed_units(config.recompute_method, config.recompute_num_layers,
                                                    len(block.layers)):
        if recompute:
            hidden_states, context = checkpoint(run(start, end), hidden_states, context,
                                                weights=stash.get((start, end)))
        else:
            hidden_states, context = run(start, end)(hidden_states, context)
    return hidden_states


def _attention_checkpointed_forward(attention: Any, query: torch.Tensor, key: torch.Tensor,
                                    value: torch.Tensor, attention_mask: Any, rotary_pos_emb: Any = None,
                                    attn_mask_type: Any = None, attention_bias: Any = None,
                                    packed_seq_params: Any = None) -> torch.Tensor:
    """``Attention._checkpointed_attention_forward`` (selective recompute) on :func:`checkpoint`:
    core attention has no weights, so it always recomputes exactly the forward's values."""
    mask_type = attention.attn_mask_type if attn_mask_type is None else attn_mask_type

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
        return attention.core_attention(q, k, v, mask, attn_mask_type=mask_type,
                                        attention_bias=attention_bias, packed_seq_params=packed_seq_params)

    return checkpoint(attend, query, key, value, attention_mask)


def install_recompute(model: torch.nn.Module, settings: RecomputeSettings) -> int:
    """Route the recompute branches of ``model``'s blocks and attentions to :func:`checkpoint`;
    return how many modules were hooked. The model's config must carry ``settings``."""
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.transformer_block import TransformerBlock

    hooked = 0
    for module in model.modules():
        if settings.granularity == "full" and isinstance(module, TransformerBlock):
            units = checkpointed_units(settings.method, settings.num_layers, len(module.layers))  # type: ignore[arg-type]
            module._recompute_stash = {
                (start, end): _RegionWeights([p for layer in module.layers[start:end] for p in layer.parameters()])
                for start, end, recompute in units if recompute and settings.stash_weights}
            module._checkpointed_forward = types.MethodType(_block_checkpointed_forward, module)
            hooked += 1
        elif settings.granularity == "selective" and isinstance(module, Attention):
            if not getattr(module, "checkpoint_core_attention", False):
                raise ValueError("selective recompute: the attention module was built without it")
            module._checkpointed_attention_forward = types.MethodType(_attention_checkpointed_forward, module)
            hooked += 1
    return hooked
