"""What :class:`~megatron.trainer.optim.adamw.StageAdamW` keeps per parameter, and the checks and
reductions around it: a :class:`Slot` (moments, optional fp32 master, owned range), how slots
are made from named parameters and loaded from a checkpoint, and the fused sum of squares.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

import torch
from torch import Tensor
from torch.nn import Parameter

NoDecayFn = Callable[[str, Parameter], bool]
# Optimizer-state sharding (ZeRO-1 over replicas, AMDP §3.4): parameter name -> the flat
# element range [start, stop) of that parameter this optimizer owns and steps.
Shards = Mapping[str, tuple[int, int]]

# Parameter dtypes that get a separate fp32 master copy.  Other dtypes (fp32,
# fp64) are precise enough to be their own master, exactly like torch.optim.
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def default_no_decay(name: str, param: Parameter) -> bool:
    """Megatron convention: no weight decay for biases and 1-D params (norm scales).

    Decaying those pulls normalisation gains and biases toward zero, which hurts
    rather than regularises; Megatron-LM excludes them by default.
    """
    return name.endswith("bias") or param.ndim == 1


@dataclass
class Slot:
    """Everything the optimizer keeps for one parameter.

    ``master`` is None when the parameter is its own master (fp32/fp64); we then
    fetch ``param.data`` at every use instead of caching an alias, so that a
    later ``param.data = ...`` (e.g. ``module.to(device)``) cannot leave us
    updating a stale tensor. ``index`` is the flat element range of the parameter
    the slot owns when the optimizer state is sharded (None: all of it); AdamW is
    element-wise, so a shard's elements get exactly the bits the whole would.
    """

    name: str
    param: Parameter
    decay: bool
    exp_avg: Tensor
    exp_avg_sq: Tensor
    master: Optional[Tensor]
    index: Optional[tuple[int, int]] = None

    def data(self) -> Tensor:
        """The owned part of ``param.data`` (a view: writes go to the parameter)."""
        if self.index is None:
            return self.param.data
        return self.param.data.view(-1)[self.index[0]:self.index[1]]

    def grad(self) -> Optional[Tensor]:
        """The owned part of ``param.grad`` (None if there is no gradient)."""
        grad = self.param.grad
        if grad is None or self.index is None:
            return grad
        return grad.view(-1)[self.index[0]:self.index[1]]

    def target(self) -> Tensor:
        """The full-precision tensor the Adam arithmetic is applied to."""
        return self.master if self.master is not None else self.data()

    def write_back(self) -> None:
        """Copy the fp32 master into the (low-precision) parameter; no-op without master."""
        if self.master is not None:
            self.data().copy_(self.master)

    def state_bytes(self) -> int:
        """Bytes of optimizer state: the moments and, for bf16/fp16 params, the master."""
        tensors = [self.exp_avg, self.exp_avg_sq] + ([self.master] if self.master is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def make_slot(name: str, param: Parameter, decay: bool, index: Optional[tuple[int, int]] = None) -> Slot:
    """Allocate master copy (if needed) and zeroed moments, on the param's device."""
    slot = Slot(name=name, param=param, decay=decay, exp_avg=param, exp_avg_sq=param, master=None, index=index)
    owned = slot.data().detach()
    if param.dtype in _LOW_PRECISION:
        slot.master = owned.to(dtype=torch.float32, copy=True)
    reference = slot.master if slot.master is not None else owned
    slot.exp_avg = torch.zeros_like(reference, memory_format=torch.preserve_format)
    slot.exp_avg_sq = torch.zeros_like(reference, memory_format=torch.preserve_format)
    return slot


def make_slots(named: list[tuple[str, Parameter]], no_decay: NoDecayFn, shards: Optional[Shards]) -> list[Slot]:
    """One slot per parameter; with ``shards``, one per non-empty owned range of a sharded one."""
    slots = []
    for name, p in named:
        index = None if shards is None or name not in shards else shards[name]
        if index is not None and not 0 <= index[0] <= index[1] <= p.numel():
            raise ValueError(f"StageAdamW: shard {index} of {name} outside its {p.numel()} elements")
        if index is None or index[1] > index[0]:
            slots.append(make_slot(name, p, not no_decay(name, p), index))
    return slots


def check_unique(named: list[tuple[str, Parameter]]) -> None:
    """Reject duplicate names or tied (shared) parameters.

    A tied parameter listed twice would be stepped twice per update; state
    dicts keyed by name would silently collide on duplicate names.
    """
    names = [name for name, _ in named]
    if len(set(names)) != len(names):
        raise ValueError("StageAdamW: duplicate parameter names")
    if len({id(p) for _, p in named}) != len(named):
        raise ValueError("StageAdamW: the same parameter is listed twice (tied weights?)")


def check_hyperparams(lr: float, weight_decay: float, betas: tuple[float, float], eps: float) -> None:
    """Validate constructor hyper-parameters with one-line messages."""
    if not lr >= 0.0:
        raise ValueError(f"StageAdamW: lr must be >= 0, got {lr}")
    if not weight_decay >= 0.0:
        raise ValueError(f"StageAdamW: weight_decay must be >= 0, got {weight_decay}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"StageAdamW: betas must be in [0, 1), got {betas}")
    if not eps >= 0.0:
        raise ValueError(f"StageAdamW: eps must be >= 0, got {eps}")


def load_slot(slot: Slot, entry: dict[str, Tensor]) -> None:
    """Copy one parameter's saved state into its live buffers."""
    if (slot.master is not None) != ("master" in entry):
        raise ValueError(f"StageAdamW.load_state_dict: master-weight mismatch for {slot.name}")
    pairs = [(slot.exp_avg, entry["exp_avg"]), (slot.exp_avg_sq, entry["exp_avg_sq"])]
    if slot.master is not None:
        pairs.append((slot.master, entry["master"]))
    for live, saved in pairs:
        if live.shape != saved.shape:
            raise ValueError(f"StageAdamW.load_state_dict: shape mismatch for {slot.name}")
    with torch.no_grad():
        for live, saved in pairs:
            live.copy_(saved)
        slot.write_back()


def sum_of_squares(grads: Iterable[Optional[Tensor]], device: torch.device) -> Tensor:
    """Sum of squares of the tensors (None counts as 0), an fp32 scalar on ``device``.

    One fused dot product per tensor (no squared temporary: 2x faster than ``square().sum()``
    on a CPU stage's 6 M gradients, as accurate: ~1e-7 relative to a float64 sum); fp16/bf16
    tensors are squared in fp32."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        if grad is None:
            continue
        flat = grad.detach().reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.float()
        total += torch.dot(flat, flat).to(device)
    return total

