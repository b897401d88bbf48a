"""One AdamW step over many tensors with torch's fused kernel, bitwise independent of sharding.

Why: the reference arithmetic (``torch.optim.AdamW(foreach=False)``'s, one kernel per
operation) streams each parameter's state through memory six times; on a CPU rank the
synchronous step costs ~20 ms per 6 M parameters, on the critical path of every flush.
``torch._fused_adamw_`` does it in one pass (~4 ms), on CPU and CUDA, in stock PyTorch.

The catch: its CPU kernel computes a vectorised body and a scalar tail of each tensor it
is given, and the two round ``exp_avg_sq`` differently. Where an element falls depends on
the tensor's length, so an element of a ZeRO shard (a flat range of a parameter) would get
other bits than the same element stepped as part of the whole parameter, and the distributed
optimizer would stop matching the plain one bit for bit. So every element goes through the
vector path: each tensor's first ``len - len % ALIGN`` elements are stepped in place, and the
remainders of all tensors are gathered into one zero-padded buffer of a multiple of ``ALIGN``
elements, stepped there and copied back. ``ALIGN`` = 64 elements is a multiple of every CPU
vector width and of the kernel's per-thread task unit, so neither the thread count nor the
shard boundaries change a result (``tests/test_fused_adamw.py``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

ALIGN = 64  # elements: a multiple of 4, 8 and 16 lanes and of the 16-float task unit


def fused_adamw_available_in_torch() -> bool:
    """Whether this torch has the fused AdamW kernel at all."""
    return hasattr(torch, "_fused_adamw_")


def fused_adamw_available(device: torch.device) -> bool:
    """Whether this torch has the fused AdamW kernel for ``device``'s type."""
    return fused_adamw_available_in_torch() and device.type in ("cpu", "cuda")


@dataclass
class FusedGroup:
    """The flat tensors of one kernel call: same device, dtype and weight decay."""

    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    exp_avgs: list[Tensor] = field(default_factory=list)
    exp_avg_sqs: list[Tensor] = field(default_factory=list)

    def add(self, param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor) -> None:
        self.params.append(param)
        self.grads.append(grad)
        self.exp_avgs.append(exp_avg)
        self.exp_avg_sqs.append(exp_avg_sq)

    def split_aligned(self) -> tuple[FusedGroup, FusedGroup]:
        """(bodies: each tensor's first multiple of ALIGN elements; tails: the rest)."""
        bodies, tails = FusedGroup(), FusedGroup()
        for tensors in zip(self.params, self.grads, self.exp_avgs, self.exp_avg_sqs):
            n = tensors[0].numel()
            cut = n - n % ALIGN
            if cut:
                bodies.add(*(t[:cut] for t in tensors))
            if cut < n:
                tails.add(*(t[cut:] for t in tensors))
        return bodies, tails


def _padded_cat(tensors: Sequence[Tensor]) -> Tensor:
    """The tensors end to end, zero-padded to a multiple of ALIGN elements (a fresh buffer)."""
    total = sum(t.numel() for t in tensors)
    out = torch.zeros(-(-total // ALIGN) * ALIGN, dtype=tensors[0].dtype, device=tensors[0].device)
    torch.cat(list(tensors), out=out[:total])
    return out


def fused_adamw_step(group: FusedGroup, step: Tensor, lr: float, betas: tuple[float, float],
                     weight_decay: float, eps: float, inverse_grad_scale: Tensor | None = None) -> None:
    """Step ``group``'s tensors in place (params, moments).

    ``group`` holds flat contiguous tensors (``view(-1)`` of a parameter, or a shard's range);
    ``step`` is the (already incremented) step count as a float tensor on their device. With
    ``inverse_grad_scale`` (a float32 scalar tensor there) the kernel divides each gradient by
    it first, writing the quotient into the gradient: grads are only read without it.
    """
    bodies, tails = group.split_aligned()
    kwargs = dict(lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=weight_decay, eps=eps,
                  amsgrad=False, maximize=False, grad_scale=inverse_grad_scale)
    if bodies.params:
        torch._fused_adamw_(bodies.params, bodies.grads, bodies.exp_avgs, bodies.exp_avg_sqs, [],
                            [step] * len(bodies.params), **kwargs)
    if tails.params:
        staged = [_padded_cat(ts) for ts in (tails.params, tails.grads, tails.exp_avgs, tails.exp_avg_sqs)]
        torch._fused_adamw_(staged[:1], staged[1:2], staged[2:3], staged[3:], [], [step], **kwargs)
        sizes = [t.numel() for t in tails.params]
        for live, buffer in ((tails.params, staged[0]), (tails.exp_avgs, staged[2]), (tails.exp_avg_sqs, staged[3])):
            torch._foreach_copy_(live, list(buffer[:sum(sizes)].split(sizes)))
