"""Free a stage's forward output as soon as it is handed to the send, keep only its graph.

After F on a stage that is not the last, the stashed output is needed for one thing only:
its ``grad_fn``, where B/BW starts autograd with the received gradient. Its values belong to
the next stage, which got them through the tensor handed to the send (a detached alias of the
same storage). So the worker swaps the stashed output's storage for a one-element tensor
right after F (the trick megatron-core's schedules call ``deallocate_output_tensor``): the
storage lives exactly as long as the send (or, in the emulator, the receiving stage) holds
the alias, not until this stage's backward.

``torch.autograd.backward`` checks the gradient's shape against the (now one-element) tensor,
so the backward of a freed output goes through megatron-core's ``custom_backward``, which
calls the same autograd engine without that check: the engine still validates the gradient
against the shape ``grad_fn`` recorded, and the arithmetic is the same, so numerics do not
change.

Not freed (left as they are, correct either way):

* views (the storage belongs to another tensor; megatron refuses them too);
* leaves and outputs without a graph (nothing to backward from, or the stage's own input);
* outputs their own ``grad_fn`` saved for backward (``tanh``, ``relu``, a custom Function
  saving its result): with a saved-tensor hook that returns the tensor itself (the activation
  meter's), the graph would read the one-element tensor in backward.
"""
from __future__ import annotations

import torch
from megatron.core.pipeline_parallel.schedules import custom_backward


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _saved_names(fn: object) -> tuple[str, ...]:
    """The attributes through which a node of ``fn``'s type exposes what it saved; looked up
    once per node type (``dir`` of an autograd node is too slow for every forward)."""
    kind = type(fn)
    names = _SAVED_NAMES.get(kind)
    if names is None:
        names = tuple(name for name in dir(fn) if name.startswith("_saved_"))
        names += ("saved_tensors",) if hasattr(kind, "saved_tensors") else ()  # custom autograd Functions
        _SAVED_NAMES[kind] = names
    return names


def _saved_by_own_node(out: torch.Tensor) -> bool:
    """Whether ``out.grad_fn`` keeps a tensor sharing ``out``'s storage for backward."""
    fn = out.grad_fn
    ptr = out.untyped_storage().data_ptr()
    for name in _saved_names(fn):
        value = getattr(fn, name)
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == ptr:
                return True
    return False


def release_output(out: torch.Tensor) -> bool:
    """Drop ``out``'s storage (keep its graph) if that is safe; return whether it was dropped.

    Call it after taking the alias to send (``out.detach()``): the alias keeps the values
    alive for the receiver, ``out`` keeps only ``grad_fn``.
    """
    if out.grad_fn is None or out._base is not None or out.numel() <= 1 or _saved_by_own_node(out):
        return False
    out.data = torch.empty((1,), dtype=out.dtype, device=out.device)
    return True


def backward_released(out: torch.Tensor, grad: torch.Tensor) -> None:
    """``torch.autograd.backward(out, grad)`` for an ``out`` that :func:`release_output` dropped."""
    custom_backward(out, grad)
