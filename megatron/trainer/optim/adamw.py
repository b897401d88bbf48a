"""Stage-local AdamW for asynchronous pipeline training.

Each pipeline stage owns a subset of the model's parameters and steps its own
optimizer on its own clock.  Asynchronous schedules apply an update *between* a
micro-batch's forward and its backward, so the update must not touch autograd's
version counter of the parameters: otherwise the in-flight backward raises
"one of the variables needed for gradient computation has been modified by an
inplace operation".  We therefore write every update through ``p.data`` (a
tensor sharing ``p``'s storage but carrying its own version counter).

Consequence worth knowing: the in-flight backward then reads the *updated*
weight values from the shared storage (activations came from the old weights,
the weight factor of the backward from the new ones).  That is exactly the
weight inconsistency that asynchronous pipeline schedules accept by design; if
a schedule needs the old values it must stash them itself.

The update is the same arithmetic, in the same order, as PyTorch's
single-tensor (``foreach=False``) ``torch.optim.AdamW``, so fp32 runs match it
bitwise.  bf16/fp16 parameters get fp32 master weights; the optimizer state
lives in the master's dtype.  Nothing here is CUDA-specific: every tensor is
created on its parameter's device.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
from torch import Tensor
from torch.nn import Parameter

from megatron.trainer.optim.adamw_rollback import AdamWRollback
from megatron.trainer.optim.adamw_slots import (
    NoDecayFn, Shards, Slot, check_hyperparams, check_unique, default_no_decay, load_slot, make_slots, sum_of_squares)
from megatron.trainer.optim.fused_adamw import FusedGroup, fused_adamw_available, fused_adamw_step
from megatron.pipeline.runtime.stage_optimizer import StageOptimizer
from megatron.pipeline.runtime.tied_embeddings import is_tied_copy


class StageAdamW(AdamWRollback, StageOptimizer):
    """AdamW over one stage's parameters, with fp32 master weights when params are bf16/fp16.

    Why not ``torch.optim.AdamW``: it updates ``p`` in place under ``no_grad``,
    which bumps the version counter and breaks in-flight backwards of an
    asynchronous pipeline; and it has no master weights for bf16 params.

    Conventions chosen here:

    * The learning rate is passed to every :meth:`step` (the stage's scheduler
      is a pure function of its local step, see ``lr_schedule.LRSchedule``);
      ``lr`` given to the constructor is only checked and kept as a default
      for callers that want one.
    * A parameter whose ``.grad`` is None at step time is treated as having a
      zero gradient (Megatron semantics: every param owns a zeroed grad buffer),
      so a single ``step_count`` drives bias correction for all parameters.
      ``torch.optim.AdamW`` would skip such a parameter instead.
    * Parameters with ``requires_grad=False`` are not optimised.
    * ``fused=True`` steps with torch's fused AdamW kernel (one pass over the state instead of
      six, :mod:`~megatron.trainer.optim.fused_adamw`): the same update to within rounding,
      the same bits whatever the sharding or thread count (``torch.optim.AdamW(fused=True)``'s
      bits on tensors of a multiple of 64 elements), but not the single-tensor arithmetic's bits.
    * ``shards`` (name -> flat element range) keeps state for, and steps, only those ranges
      of the named parameters (ZeRO-1 across identical replicas, AMDP §3.4): the other
      elements are left to their owners and arrive by all-gather
      (``megatron.pipeline.runtime.replicas``). Unnamed parameters are owned whole.
    """

    def __init__(
        self,
        params: Iterable[tuple[str, Parameter]],
        lr: float,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        no_decay_fn: Optional[NoDecayFn] = None,
        exact: bool = False,
        shards: Optional[Shards] = None,
        fused: bool = False,
    ) -> None:
        betas = (float(betas[0]), float(betas[1]))
        check_hyperparams(lr, weight_decay, betas, eps)
        named = [(name, p) for name, p in params if p.requires_grad]
        check_unique(named)
        no_decay = no_decay_fn if no_decay_fn is not None else default_no_decay
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.betas = betas
        self.eps = float(eps)
        self.step_count: int = 0
        # Every parameter (for grads, norms, zero_grad); the slots hold the state of what this
        # optimizer steps: everything, or with ``shards`` only the owned ranges (ZeRO-1).
        self._named = named
        self.sharded = shards is not None
        self._slots = make_slots(named, no_decay, shards)
        self.fused = bool(fused)
        if self.fused:
            self._check_fusable()
        # Rollback support (optimizer post-validation): the (lr, grad_scale) of the last
        # step while it can still be rolled back, and in exact mode a backup of every
        # slot's (target, exp_avg, exp_avg_sq) from before that step.
        self.exact = bool(exact)
        self._last_step: Optional[tuple[float, float]] = None
        self._backup: dict[int, tuple[Tensor, Tensor, Tensor]] = {}  # slot index -> (target, m, v)
        self._exact_slots: tuple[int, ...] = ()  # backed up without ``exact`` (roll_back_exactly)

    # ------------------------------------------------------------------ params

    def parameters(self) -> list[Parameter]:
        """The parameters this optimizer updates (sharded: owns a part of), in construction order."""
        return [p for _, p in self._named]

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        """(name, parameter) pairs, in construction order."""
        return list(self._named)

    def state_bytes(self) -> int:
        """Bytes of optimizer state held here (moments, fp32 masters): what sharding divides."""
        return sum(slot.state_bytes() for slot in self._slots)

    @property
    def no_decay_names(self) -> frozenset[str]:
        """Names of parameters excluded from weight decay (for logging and tests)."""
        return frozenset(slot.name for slot in self._slots if not slot.decay)

    def master_weight(self, name: str) -> Tensor:
        """The full-precision tensor updated for ``name`` (the param's data if fp32)."""
        for slot in self._slots:
            if slot.name == name:
                return slot.target()
        raise KeyError(name)

    def _device(self) -> torch.device:
        """Where scalar reductions live: the (first) parameter's device."""
        return self._named[0][1].device if self._named else torch.device("cpu")

    # ------------------------------------------------------------ grad checks

    def _grads(self) -> list[Tensor]:
        """Existing gradients, detached (None grads are skipped: they count as 0)."""
        return [p.grad.detach() for _, p in self._named if p.grad is not None]

    def grad_sq_norm(self) -> Tensor:
        """Sum of squares of all grads as an fp32 scalar on the params' device.

        Returned as a tensor (no host sync) so that a pipeline-parallel caller
        can all-reduce it across stages before taking the square root.  Low-precision
        grads are cast to fp32 before squaring because fp16 squares overflow.
        """
        # A tied embedding's copy on the output layer's stage is the same weight: counted once.
        return sum_of_squares((p.grad for _, p in self._named if not is_tied_copy(p)), self._device())

    def owned_grad_sq_norm(self) -> Tensor:
        """Sum of squares of the gradient elements this optimizer steps (all of them unsharded;
        the owned ranges when sharded): the distributed optimizer sums these over its replicas."""
        # The tied embedding's copy is left out as in :meth:`grad_sq_norm`: counted once.
        return sum_of_squares((slot.grad() for slot in self._slots if not is_tied_copy(slot.param)), self._device())

    def grads_finite(self) -> bool:
        """True when no grad holds inf/NaN.

        Checked element-wise rather than via ``grad_sq_norm``: a sum of squares
        of large but finite grads can itself overflow to inf.
        """
        device = self._device()
        flags = [torch.isfinite(grad).all().to(device) for grad in self._grads()]
        if not flags:
            return True
        return bool(torch.stack(flags).all().item())

    @staticmethod
    def clip_coef(total_norm: float, max_norm: float) -> float:
        """Megatron's clip factor: ``max_norm / (total_norm + 1e-6)`` if below 1, else 1.

        The 1e-6 keeps a zero norm from dividing by zero.  A NaN ``total_norm``
        yields 1.0, so check :meth:`grads_finite` before trusting the result.
        """
        if not max_norm > 0.0:
            raise ValueError(f"clip_coef: max_norm must be > 0, got {max_norm}")
        coef = max_norm / (total_norm + 1e-6)
        return coef if coef < 1.0 else 1.0

    # ------------------------------------------------------------------- step

    def step(self, lr: float, grad_scale: float = 1.0, grads_disposable: bool = False) -> None:
        """Apply one AdamW update with learning rate ``lr``.

        Grads are multiplied by ``grad_scale`` (the clip coefficient) out of
        place, so ``p.grad`` is left untouched.  Weight decay is decoupled
        (``p *= 1 - lr*wd`` before the Adam update), bias correction uses the
        incremented ``step_count``, and the operation order mirrors
        ``torch.optim.adam._single_tensor_adam`` for bitwise parity.

        ``grads_disposable``: the caller zeroes the gradients right after (the runtime's OPT does),
        so the fused kernel may scale them in place instead of working on a scaled copy; the
        bits are the same either way. Without it ``p.grad`` is never changed (a rollback
        re-reads it).
        """
        if not (math.isfinite(lr) and lr >= 0.0):
            raise ValueError(f"StageAdamW.step: lr must be finite and >= 0, got {lr}")
        if not (math.isfinite(grad_scale) and grad_scale >= 0.0):
            raise ValueError(f"StageAdamW.step: grad_scale must be finite and >= 0, got {grad_scale}")
        if self.exact or self._exact_slots:
            self._save_backup()
        self.step_count += 1
        with torch.no_grad():
            if self.fused:
                self._fused_step(lr, grad_scale, grads_disposable)
            else:
                step_size, bias_correction2_sqrt = self._bias_corrections(lr)
                for slot in self._slots:
                    self._update(slot, lr, grad_scale, step_size, bias_correction2_sqrt)
        self._last_step = (float(lr), float(grad_scale))

    def step_consuming_grads(self, lr: float, grad_scale: float = 1.0) -> None:
        """:meth:`step` for a caller that zeroes the gradients next (the runtime's OPT): their
        values afterwards are unspecified, so the fused kernel scales them in place."""
        self.step(lr, grad_scale, grads_disposable=True)

    def _check_fusable(self) -> None:
        """Refuse ``fused`` where the kernel cannot run this optimizer's update."""
        if type(self)._adam_update is not StageAdamW._adam_update:
            raise ValueError(f"{type(self).__name__}: fused=True runs plain Adam; this optimizer changes its update")
        for slot in self._slots:
            target = slot.target()
            if not fused_adamw_available(target.device):
                raise ValueError(f"StageAdamW: no fused AdamW kernel for {target.device} in this torch")
            if not (target.is_contiguous() and target.is_floating_point()):
                raise ValueError(f"StageAdamW: fused=True needs contiguous floating-point {slot.name}")

    def _fused_step(self, lr: float, grad_scale: float, grads_disposable: bool) -> None:
        """:meth:`step`'s update through the fused kernel, one call per (device, dtype, decay).

        The kernel applies ``grad_scale`` itself (dividing by its float32 reciprocal, in place
        in the gradient it is given), so a gradient the caller still needs goes in as a copy.
        """
        scaled = grad_scale != 1.0
        groups: dict[tuple[torch.device, torch.dtype, bool], FusedGroup] = {}
        for slot in self._slots:
            target = slot.target()
            decay = slot.decay and self.weight_decay != 0
            grad = slot.grad()
            if grad is None:
                grad = torch.zeros_like(target)
            elif grad.dtype != target.dtype:
                grad = grad.detach().to(dtype=target.dtype)  # a private copy already
            elif scaled and not grads_disposable:
                grad = grad.detach().clone(memory_format=torch.contiguous_format)
            else:
                grad = grad.detach()
            groups.setdefault((target.device, target.dtype, decay), FusedGroup()).add(
                target.view(-1), grad.contiguous().view(-1), slot.exp_avg.view(-1), slot.exp_avg_sq.view(-1))
        steps: dict[torch.device, tuple[Tensor, Tensor | None]] = {}
        for (device, _dtype, decay), group in groups.items():
            if device not in steps:
                steps[device] = (torch.tensor(float(self.step_count), dtype=torch.float32, device=device),
                                 torch.tensor(1.0 / grad_scale, dtype=torch.float32, device=device) if scaled else None)
            step, inverse_scale = steps[device]
            fused_adamw_step(group, step, lr, self.betas, self.weight_decay if decay else 0.0, self.eps, inverse_scale)
        for slot in self._slots:
            slot.write_back()

    def _bias_corrections(self, lr: float) -> tuple[float, float]:
        """(lr / (1 - beta1^t), sqrt(1 - beta2^t)) exactly as torch computes them.

        torch keeps the step in a float tensor and reads it back as a Python
        float, so we raise the betas to a float too.
        """
        beta1, beta2 = self.betas
        step = float(self.step_count)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        return lr / bias_correction1, bias_correction2**0.5

    def _update(
        self, slot: Slot, lr: float, grad_scale: float, step_size: float, bias_correction2_sqrt: float
    ) -> None:
        """One parameter's AdamW update, written through master / ``p.data`` only."""
        target = slot.target()
        grad = self._scaled_grad(slot, target, grad_scale)
        if slot.decay and self.weight_decay != 0:
            target.mul_(1 - lr * self.weight_decay)
        self._adam_update(slot, target, grad, step_size, bias_correction2_sqrt)
        slot.write_back()

    def _adam_update(self, slot: Slot, target: Tensor, grad: Tensor, step_size: float,
                     bias_correction2_sqrt: float) -> None:
        """The moment updates and the Adam step on ``target`` (decay already applied).

        Split out of :meth:`_update` so that a subclass can run the same Adam arithmetic in
        another basis (``basis_rotation.BasisRotationAdamW``) while sharing grad scaling,
        decoupled weight decay and the master-weight copy.
        """
        beta1, beta2 = self.betas
        slot.exp_avg.lerp_(grad, 1 - beta1)
        slot.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (slot.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
        target.addcdiv_(slot.exp_avg, denom, value=-step_size)

    @staticmethod
    def _scaled_grad(slot: Slot, target: Tensor, grad_scale: float) -> Tensor:
        """The grad in the master's dtype, times ``grad_scale``; zeros if the grad is None.

        Skips the multiply when ``grad_scale == 1`` so unclipped steps stay
        bitwise identical to torch.optim.AdamW.
        """
        grad = slot.grad()
        if grad is None:
            return torch.zeros_like(target)
        grad = grad.detach().to(dtype=target.dtype)
        if grad_scale != 1.0:
            grad = grad * grad_scale
        return grad

    def zero_grad(self) -> None:
        """Drop the gradients (``p.grad = None``), as ``torch.optim``'s default does.

        Why not zero them in place: the next backward then assigns each parameter's first
        gradient instead of adding it to zeros, which saves a pass over every gradient twice
        per update (the zeroing and the first accumulation; 4 % of a micro-batch's backward
        on a CPU GPT stage), and the values are the same (``0 + g == g``). Nothing holds on
        to a ``.grad`` tensor across updates: the overlapped reduction copies into buckets of
        its own, and every reader takes a missing gradient as zeros.
        """
        for _, p in self._named:
            p.grad = None

    # ------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        """Snapshot (cloned tensors) of step_count, moments and fp32 masters, keyed by name.

        Cloned so that continued training does not mutate a dict that is still
        being written to disk.  Masters are stored only for bf16/fp16 params:
        an fp32 param is its own master and is saved with the model.
        """
        params: dict[str, dict[str, Tensor]] = {}
        for slot in self._slots:
            entry = {"exp_avg": slot.exp_avg.clone(), "exp_avg_sq": slot.exp_avg_sq.clone()}
            if slot.master is not None:
                entry["master"] = slot.master.clone()
            params[slot.name] = entry
        return {"step_count": self.step_count, "params": params}

    def load_state_dict(self, sd: dict) -> None:
        """Restore a :meth:`state_dict` snapshot exactly.

        Values are copied into the live buffers, so a checkpoint saved on one
        device loads onto params on another.  Restored masters are also copied
        into ``p.data`` to re-establish the invariant ``p == master.to(p.dtype)``.
        """
        if "rotation" in sd and type(self) is StageAdamW:
            raise ValueError("StageAdamW.load_state_dict: the checkpoint holds basis-rotation state "
                             "(saved with --optimizer basis-rotation); its bases would be dropped")
        if "muon" in sd and type(self) is StageAdamW:
            raise ValueError("StageAdamW.load_state_dict: the checkpoint holds Muon state (saved with "
                             "--optimizer muon); its momentum is not Adam's first moment")
        entries = sd["params"]
        expected = {slot.name for slot in self._slots}
        if set(entries) != expected:
            missing, extra = sorted(expected - set(entries)), sorted(set(entries) - expected)
            raise ValueError(f"StageAdamW.load_state_dict: missing {missing}, unexpected {extra}")
        for slot in self._slots:
            load_slot(slot, entries[slot.name])
        self.step_count = int(sd["step_count"])
        self._last_step = None  # a loaded state has no step to roll back


__all__ = ["NoDecayFn", "Shards", "StageAdamW", "default_no_decay"]
