"""Undoing :class:`~megatron.trainer.optim.adamw.StageAdamW`'s last step (optimizer
post-validation): in place by inverting the update, or bitwise from a backup (``exact``).

A mixin: it reads the optimizer's slots, hyper-parameters and step arithmetic.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron.trainer.optim.adamw_slots import Slot


class AdamWRollback:
    """:meth:`rollback` and the backups of ``exact`` mode, for :class:`StageAdamW`."""

    def rollback(self, lr: float, grad_scale: float = 1.0) -> None:
        """Undo the last :meth:`step`, which must have been ``step(lr, grad_scale)``.

        Zero Bubble's in-place rollback (Qi et al., Appendix C, Algorithm 1) adapted to
        this step's arithmetic, using the *same* gradients as the step (so ``.grad`` must
        not have been zeroed or accumulated into since), in this order:

        1. ``theta = (theta + step_size * m / denom) / (1 - lr * wd)`` with the post-step
           ``m``, ``v`` and ``t`` (``denom`` computed exactly as the step computed it);
        2. ``m = (m - (1 - beta1) g) / beta1`` and ``v = (v - (1 - beta2) g^2) / beta2``,
           with ``(1 - beta1) g`` and ``(1 - beta2) g^2`` rounded exactly as the step rounds
           them (so zero moments are restored exactly);
        3. ``t = t - 1``;

        on the fp32 master weights, then re-copied into ``p.data`` for bf16/fp16 params.

        Floating point: the inverse divides by ``beta1``, ``beta2`` and ``1 - lr * wd``
        and subtracts nearly equal numbers, so it restores the state to within a few ulp
        of each value, not bitwise (a moment that was ~0 before the step comes back as a
        tiny rounding residue instead of 0). With ``exact=True`` the optimizer instead
        keeps a copy of (theta, m, v) from before every step and restores it bitwise, at
        the cost of one more copy of the optimizer state in memory;
        :meth:`roll_back_exactly` does the same for some parameters only.

        Only the most recent step can be rolled back, once.
        """
        if self._last_step is None:
            raise RuntimeError("StageAdamW.rollback: no step to roll back (already rolled back, or none taken)")
        if self._last_step != (float(lr), float(grad_scale)):
            raise ValueError(
                f"StageAdamW.rollback: the last step used (lr, grad_scale) = {self._last_step}, "
                f"got ({lr}, {grad_scale})")
        if self.exact:
            self._restore_backup()
        else:
            exact = set(self._exact_slots)
            beta1, beta2 = self.betas
            if beta1 == 0.0 or beta2 == 0.0:
                raise RuntimeError("StageAdamW.rollback: in-place rollback needs beta1, beta2 > 0 (use exact=True)")
            if self.weight_decay != 0 and lr * self.weight_decay == 1.0:
                raise RuntimeError("StageAdamW.rollback: lr * weight_decay == 1 cannot be inverted (use exact=True)")
            step_size, bias_correction2_sqrt = self._bias_corrections(lr)  # post-step t
            with torch.no_grad():
                for i, slot in enumerate(self._slots):
                    if i not in exact:
                        self._invert(slot, lr, grad_scale, step_size, bias_correction2_sqrt)
            if exact:
                self._restore_backup()
        self.step_count -= 1
        self._last_step = None

    def _invert(
        self, slot: Slot, lr: float, grad_scale: float, step_size: float, bias_correction2_sqrt: float
    ) -> None:
        """One parameter's rollback (see :meth:`rollback`), written through master / ``p.data``."""
        beta1, beta2 = self.betas
        target = slot.target()
        grad = self._scaled_grad(slot, target, grad_scale)
        # theta: the step's own denominator (same dtype, same arithmetic), the inverse in
        # float64 so that it adds as little rounding as possible to what the step lost.
        denom = (slot.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
        theta = target.double().addcdiv_(slot.exp_avg.double(), denom.double(), value=step_size)
        if slot.decay and self.weight_decay != 0:
            theta.div_(1 - lr * self.weight_decay)
        target.copy_(theta)
        # Moments: subtract the increment the step's own kernels produce from a zero moment
        # (so a moment that was exactly 0, e.g. an embedding row with no gradient yet, comes
        # back exactly 0 instead of as rounding residue that Adam would later divide by ~eps),
        # then divide by beta in float64.
        inc_m = torch.zeros_like(slot.exp_avg).lerp_(grad, 1 - beta1)
        slot.exp_avg.copy_((slot.exp_avg.double() - inc_m.double()).div_(beta1))
        inc_v = torch.zeros_like(slot.exp_avg_sq).addcmul_(grad, grad, value=1 - beta2)
        slot.exp_avg_sq.copy_((slot.exp_avg_sq.double() - inc_v.double()).div_(beta2).clamp_(min=0.0))
        slot.write_back()

    def roll_back_exactly(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Make :meth:`rollback` restore ``params`` bitwise whatever the others' rollback: their
        (target, exp_avg, exp_avg_sq) are backed up before every step, as ``exact`` backs up
        every slot. Post-validation's tied embedding: its two ends live on two stages, of which
        one may roll back a step the other never took, so an end must come back to the very
        bits its other end kept."""
        wanted = {id(p) for p in params}
        self._exact_slots = tuple(i for i, slot in enumerate(self._slots) if id(slot.param) in wanted)

    def _backed_up(self) -> list[int]:
        """The slots :meth:`_save_backup` copies: all (``exact``), or :meth:`roll_back_exactly`'s."""
        return list(range(len(self._slots))) if self.exact else list(self._exact_slots)

    def _save_backup(self) -> None:
        """Copy the backed-up slots' (target, exp_avg, exp_avg_sq) into reused buffers."""
        with torch.no_grad():
            for i in self._backed_up():
                slot = self._slots[i]
                if i not in self._backup:
                    self._backup[i] = (torch.empty_like(slot.target()), torch.empty_like(slot.exp_avg),
                                       torch.empty_like(slot.exp_avg_sq))
                theta, m, v = self._backup[i]
                theta.copy_(slot.target())
                m.copy_(slot.exp_avg)
                v.copy_(slot.exp_avg_sq)

    def _restore_backup(self) -> None:
        with torch.no_grad():
            for i in self._backed_up():
                slot, (theta, m, v) = self._slots[i], self._backup[i]
                slot.target().copy_(theta)
                slot.exp_avg.copy_(m)
                slot.exp_avg_sq.copy_(v)
                slot.write_back()
