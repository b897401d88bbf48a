"""``--optimizer muon``: Muon for a stage's 2-D hidden weights, AdamW for everything else.

Muon (Keller Jordan 2024; "Muon is Scalable for LLM Training", Liu et al. 2025) keeps a momentum
buffer per weight matrix and steps along an orthogonalised version of it (Newton–Schulz,
:mod:`~megatron.trainer.optim.newton_schulz`). As in megatron-core's ``get_megatron_muon_optimizer``
and torch's ``Muon`` recipes, only 2-D weights that are neither the embedding nor the output layer
are orthogonalised (a vocabulary-indexed matrix's rows are separate tokens, not one linear map);
biases, norm scales, embeddings and the output layer run :class:`StageAdamW`'s AdamW.

Why a subclass of :class:`StageAdamW` rather than megatron-core's ``TensorParallelMuon``: that
class needs the ``emerging-optimizers`` package (not installed with the pinned wheel) and steps
through ``torch.optim``'s in-place updates, which an asynchronous schedule cannot take between a
micro-batch's forward and its backward. Here every write goes through ``p.data`` / the fp32 master
like AdamW's, so stage-local steps, the clocks of asynchronous schedules, exact backups for
post-validation, checkpoints and the grad-norm reductions are StageAdamW's unchanged; a Muon slot
keeps its momentum in ``exp_avg`` and an empty ``exp_avg_sq``.

The Muon step per weight (torch 2.13's ``torch.optim.Muon`` arithmetic, in its order)::

    B <- lerp(B, g, 1 - mu)                     # momentum
    U <- lerp(g, B, mu) if nesterov else B
    O <- NS_k(U)                                # per Q/K/V block of a fused QKV weight (split_qkv)
    W <- W (1 - lr wd)                          # decoupled weight decay
    W <- W - lr * scale(m, n) * extra * O
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import Tensor
from torch.nn import Parameter

from megatron.trainer.optim.adamw import NoDecayFn, StageAdamW
from megatron.trainer.optim.adamw_slots import Slot
from megatron.trainer.optim.basis_rotation import VOCABULARY_PARAMETERS
from megatron.trainer.optim.newton_schulz import NS_DTYPES, SCALE_MODES, newton_schulz, scale_factor

#: the fused attention input projection megatron-core splits into Q, K, V for Muon
QKV_WEIGHT = "linear_qkv.weight"


@dataclass(frozen=True)
class MuonConfig:
    """Muon's hyper-parameters (megatron-core's ``muon_*`` names) and the QKV layout."""

    momentum: float = 0.95
    use_nesterov: bool = False
    num_ns_steps: int = 5
    scale_mode: str = "spectral"
    extra_scale_factor: float = 1.0
    ns_dtype: str = "float32"
    #: rows of one query group of a fused QKV weight: (query, key, value); None: no split
    qkv_split: Optional[tuple[int, int, int]] = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"muon momentum must be in [0, 1), got {self.momentum}")
        if self.num_ns_steps < 1:
            raise ValueError(f"muon num_ns_steps must be >= 1, got {self.num_ns_steps}")
        if self.scale_mode not in SCALE_MODES:
            raise ValueError(f"muon scale mode must be one of {SCALE_MODES}, got {self.scale_mode!r}")
        if self.ns_dtype not in NS_DTYPES:
            raise ValueError(f"muon ns dtype must be one of {tuple(NS_DTYPES)}, got {self.ns_dtype!r}")
        if not self.extra_scale_factor > 0.0:
            raise ValueError(f"muon extra scale factor must be > 0, got {self.extra_scale_factor}")


def orthogonalisable(name: str, param: Parameter) -> bool:
    """Whether Muon steps ``name``: a 2-D hidden weight (not the embedding, not the output layer)."""
    return param.ndim == 2 and min(param.shape) > 0 and not any(part in name for part in VOCABULARY_PARAMETERS)


def qkv_split_rows(num_attention_heads: int, num_query_groups: int | None, kv_channels: int | None,
                   hidden_size: int) -> tuple[int, int, int]:
    """(query, key, value) rows of one query group of megatron-core's fused QKV weight."""
    groups = num_query_groups or num_attention_heads
    channels = kv_channels or hidden_size // num_attention_heads
    return (num_attention_heads // groups * channels, channels, channels)


class StageMuon(StageAdamW):
    """:class:`StageAdamW` whose 2-D hidden weights take Muon's orthogonalised step (module doc)."""

    def __init__(
        self,
        params: Iterable[tuple[str, Parameter]],
        lr: float,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        no_decay_fn: NoDecayFn | None = None,
        exact: bool = False,
        muon: MuonConfig = MuonConfig(),
    ) -> None:
        super().__init__(params, lr, weight_decay, betas, eps, no_decay_fn, exact=exact)
        self.muon = muon
        self._muon_names = frozenset(slot.name for slot in self._slots if orthogonalisable(slot.name, slot.param))
        for slot in self._slots:
            if slot.name in self._muon_names:
                self._check_split(slot)
                slot.exp_avg_sq = slot.exp_avg.new_empty(0)  # Muon keeps no second moment

    @property
    def orthogonalised_names(self) -> frozenset[str]:
        """Parameters stepped by Muon (the rest run AdamW)."""
        return self._muon_names

    def _blocks(self, slot: Slot) -> Optional[tuple[int, int, int]]:
        """The Q/K/V row split of ``slot`` (None: orthogonalised whole)."""
        split = self.muon.qkv_split
        return split if split is not None and slot.name.endswith(QKV_WEIGHT) else None

    def _check_split(self, slot: Slot) -> None:
        split = self._blocks(slot)
        if split is not None and slot.param.shape[0] % sum(split):
            raise ValueError(f"StageMuon: {slot.name} has {slot.param.shape[0]} rows, not a multiple of a query "
                             f"group's {sum(split)} (Q/K/V rows {split}): it cannot be split for Muon")

    # ------------------------------------------------------------------- step

    def orthogonalise(self, slot: Slot, update: Tensor) -> tuple[Tensor, float]:
        """``(O, s)`` with ``s * O`` the scaled orthogonalised update.

        A whole matrix returns ``NS(update)`` in the NS dtype and its scale, which the caller folds
        into the step's ``alpha`` (torch's Muon does, so its bits are reproduced); a fused QKV
        weight is orthogonalised per Q/K/V block of every query group (megatron-core's
        ``split_qkv``), each block scaled by its own shape's factor in ``update``'s dtype (s = 1).
        """
        steps, dtype = self.muon.num_ns_steps, NS_DTYPES[self.muon.ns_dtype]
        split = self._blocks(slot)
        if split is None:
            return newton_schulz(update, steps, dtype), self._scale(update)
        rows, cols = update.shape
        groups = update.view(rows // sum(split), sum(split), cols)
        parts = []
        for block in torch.split(groups, list(split), dim=1):
            flat = block.reshape(-1, cols)
            parts.append((newton_schulz(flat, steps, dtype).to(update.dtype) * self._scale(flat)).view(block.shape))
        return torch.cat(parts, dim=1).view(rows, cols), 1.0

    def _scale(self, matrix: Tensor) -> float:
        return scale_factor(matrix.shape[0], matrix.shape[1], self.muon.scale_mode) * self.muon.extra_scale_factor

    def _nesterov_input(self, grad: Tensor, momentum: Tensor) -> Tensor:
        return grad.lerp(momentum, self.muon.momentum) if self.muon.use_nesterov else momentum

    def _update(self, slot: Slot, lr: float, grad_scale: float, step_size: float,
                bias_correction2_sqrt: float) -> None:
        """Muon's step for an orthogonalised slot (module doc), AdamW's for the others."""
        if slot.name not in self._muon_names:
            super()._update(slot, lr, grad_scale, step_size, bias_correction2_sqrt)
            return
        target = slot.target()
        grad = self._scaled_grad(slot, target, grad_scale)
        slot.exp_avg.lerp_(grad, 1 - self.muon.momentum)
        ortho, scale = self.orthogonalise(slot, self._nesterov_input(grad, slot.exp_avg))
        if slot.decay and self.weight_decay != 0:
            target.mul_(1 - lr * self.weight_decay)
        target.add_(ortho, alpha=-(lr * scale))
        slot.write_back()

    def _invert(self, slot: Slot, lr: float, grad_scale: float, step_size: float,
                bias_correction2_sqrt: float) -> None:
        """In-place rollback of an orthogonalised slot: the step's own ``O`` is recomputed from the
        post-step momentum and the same gradient (bitwise the step's), then the weight and the
        momentum are inverted in float64 (a few ulp, like AdamW's; ``exact`` restores bitwise)."""
        if slot.name not in self._muon_names:
            super()._invert(slot, lr, grad_scale, step_size, bias_correction2_sqrt)
            return
        mu = self.muon.momentum
        if mu == 0.0:
            raise RuntimeError("StageMuon.rollback: in-place rollback needs muon momentum > 0 (use exact=True)")
        target = slot.target()
        grad = self._scaled_grad(slot, target, grad_scale)
        ortho, scale = self.orthogonalise(slot, self._nesterov_input(grad, slot.exp_avg))
        theta = target.double().add_(ortho.double(), alpha=lr * scale)
        if slot.decay and self.weight_decay != 0:
            theta.div_(1 - lr * self.weight_decay)
        target.copy_(theta)
        increment = torch.zeros_like(slot.exp_avg).lerp_(grad, 1 - mu)
        slot.exp_avg.copy_((slot.exp_avg.double() - increment.double()).div_(mu))
        slot.write_back()

    # ------------------------------------------------------------ checkpoint

    def _muon_state(self) -> dict[str, list[int] | None]:
        """Per orthogonalised parameter, its Q/K/V row split (None: whole). Keyed by parameter
        name so that a relayout (checkpointing.reshard) merges the stages' entries like AdamW's."""
        return {name: (None if (split := self._blocks(slot)) is None else list(split))
                for slot in self._slots if (name := slot.name) in self._muon_names}

    def state_dict(self) -> dict:
        """StageAdamW's snapshot (Muon's momentum in ``exp_avg``) plus which weights Muon steps."""
        sd = super().state_dict()
        for name in self._muon_names:  # no second moment: the entry holds what a relayout must carry
            del sd["params"][name]["exp_avg_sq"]
        sd["muon"] = self._muon_state()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Restore a :meth:`state_dict` snapshot exactly; refuse one saved by another optimizer."""
        saved = sd.get("muon")
        if saved is None:
            raise ValueError("StageMuon.load_state_dict: the checkpoint has no Muon state (saved with another "
                             "--optimizer?)")
        saved = {name: None if split is None else list(split) for name, split in saved.items()}
        if saved != self._muon_state():
            raise ValueError(f"StageMuon.load_state_dict: checkpoint Muon layout {saved}, this run "
                             f"{self._muon_state()}")
        empty = {slot.name: slot.exp_avg_sq for slot in self._slots if slot.name in self._muon_names}
        params = {name: {**entry, "exp_avg_sq": empty[name]} if name in empty else entry
                  for name, entry in sd["params"].items()}
        super().load_state_dict({**sd, "params": params})
