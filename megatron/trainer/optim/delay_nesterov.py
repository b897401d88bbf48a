"""``--optimizer delay-nesterov``: Nesterov-accelerated Adam whose look-ahead grows with the
stage's gradient delay (Ajanthan et al., "Nesterov Method for Asynchronous Pipeline Parallel
Optimization", ICML 2025, arXiv 2505.01099).

The paper's idea: NAG evaluates the gradient at a look-ahead point ``w + mu d`` along the
momentum; under asynchronous pipelining a stage's gradient is already ``tau`` updates stale, so
the look-ahead is stretched to account for the delay, which lets the stale gradient act like a
gradient at the point the weights are heading to. The update implemented here is the one of the
authors' released code (``AsyncPP``, read, not copied; the paper's text was not available
offline): Adam with Nesterov momentum (NAdam, Dozat 2016, with decoupled weight decay; torch's
``NAdam(decoupled_weight_decay=True)`` arithmetic, in its order) and a momentum coefficient
raised with the stage's delay ``tau_s`` (their ``--adaptive_momentum``)::

    beta1_s = beta1 + tau_s * (beta1_max - beta1) / N

    mu_t    = beta1_s (1 - 0.5 * 0.96^(t psi))            (psi: --nadam-momentum-decay)
    W      <- W (1 - lr wd)
    m      <- lerp(m, g, 1 - beta1_s);   v <- beta2 v + (1 - beta2) g^2
    d       = sqrt(v / (1 - beta2^t)) + eps
    W      <- W - lr (1 - mu_t) / (1 - prod_{i<=t} mu_i) * g / d
             - lr mu_{t+1} / (1 - prod_{i<=t+1} mu_i) * m / d          (the look-ahead term)

``tau_s`` is the schedule's declared bound (``SchedulePolicy.gradient_delays``: PACI's
``ceil((N-1-s)/a)``, one update for PipeDream-2BW and AMDP, PipeMare's PACI streams), so the
delay-free last stage of PACI runs plain NAdam and deeper, staler stages look further ahead.
Synchronous schedules declare no delay and are refused.

``prod mu`` is kept in float32 and read back as a Python float, as torch keeps it, so that one
stage equals ``torch.optim.NAdam`` bit for bit; it is a pure function of ``(beta1_s, psi, t)``
and is recomputed on load rather than checkpointed (a relayout that changes a stage's delay
then continues with the new ``beta1_s``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor
from torch.nn import Parameter

from megatron.trainer.optim.adamw import NoDecayFn, StageAdamW
from megatron.trainer.optim.adamw_slots import Shards, Slot

#: torch's and the authors' default ``psi``
MOMENTUM_DECAY = 0.004
#: the authors' ceiling of the delay-adapted momentum
MAX_MOMENTUM = 0.99


@dataclass(frozen=True)
class Lookahead:
    """The stage's delay and the look-ahead's hyper-parameters."""

    delay: int
    num_stages: int
    max_momentum: float = MAX_MOMENTUM
    momentum_decay: float = MOMENTUM_DECAY

    def __post_init__(self) -> None:
        if not 0 <= self.delay < max(1, self.num_stages) + 1:
            raise ValueError(f"delay {self.delay} outside 0..{self.num_stages}")
        if not 0.0 <= self.max_momentum < 1.0:
            raise ValueError(f"lookahead max momentum must be in [0, 1), got {self.max_momentum}")
        if not self.momentum_decay >= 0.0:
            raise ValueError(f"nadam momentum decay must be >= 0, got {self.momentum_decay}")

    def beta1(self, base: float) -> float:
        """``beta1_s = beta1 + tau_s (beta1_max - beta1) / N`` (never below ``base``)."""
        if self.max_momentum < base:
            raise ValueError(f"lookahead max momentum {self.max_momentum} is below --adam-beta1 {base}")
        return base + self.delay * (self.max_momentum - base) / self.num_stages


def momentum_cache(beta1: float, momentum_decay: float, step: int) -> float:
    """``mu_t`` of NAdam's momentum schedule (torch's formula, in its order)."""
    return beta1 * (1.0 - 0.5 * (0.96 ** (step * momentum_decay)))


class DelayNesterovAdamW(StageAdamW):
    """StageAdamW with NAdam's look-ahead update and a delay-adapted ``beta1`` (module doc)."""

    def __init__(
        self,
        params: Iterable[tuple[str, Parameter]],
        lr: float,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        no_decay_fn: NoDecayFn | None = None,
        lookahead: Lookahead = Lookahead(delay=0, num_stages=1),
        shards: Shards | None = None,
    ) -> None:
        """``shards``: as StageAdamW's (ZeRO-1); the update is element-wise, so a shard gets the
        bits the whole would."""
        stage_betas = (lookahead.beta1(float(betas[0])), float(betas[1]))
        super().__init__(params, lr, weight_decay, stage_betas, eps, no_decay_fn, exact=False, shards=shards)
        self.lookahead = lookahead
        self._mu_product = torch.ones((), dtype=torch.float32)
        self._coefficients: tuple[float, float, float] = (0.0, 0.0, 1.0)

    def step(self, lr: float, grad_scale: float = 1.0, grads_disposable: bool = False) -> None:
        """StageAdamW's step (grad scaling, decay, masters) with NAdam's coefficients for step t."""
        beta1, beta2 = self.betas
        t = self.step_count + 1
        mu = momentum_cache(beta1, self.lookahead.momentum_decay, t)
        mu_next = momentum_cache(beta1, self.lookahead.momentum_decay, t + 1)
        product = self._mu_product * mu
        self._coefficients = (-lr * (1.0 - mu) / (1.0 - product.item()),
                              (-lr * mu_next) / (1.0 - product.item() * mu_next),
                              1 - beta2 ** float(t))
        super().step(lr, grad_scale, grads_disposable)
        self._mu_product = product

    def _adam_update(self, slot: Slot, target: Tensor, grad: Tensor, step_size: float,
                     bias_correction2_sqrt: float) -> None:
        """NAdam's moments and its two-term update (gradient, then the look-ahead momentum)."""
        beta1, beta2 = self.betas
        grad_coefficient, momentum_coefficient, bias_correction2 = self._coefficients
        slot.exp_avg.lerp_(grad, 1 - beta1)
        slot.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = slot.exp_avg_sq.div(bias_correction2).sqrt().add_(self.eps)
        target.addcdiv_(grad, denom, value=grad_coefficient)
        target.addcdiv_(slot.exp_avg, denom, value=momentum_coefficient)

    def rollback(self, lr: float, grad_scale: float = 1.0) -> None:
        raise NotImplementedError("DelayNesterovAdamW.rollback: post-validation runs only synchronous schedules, "
                                  "which --optimizer delay-nesterov refuses")

    def load_state_dict(self, sd: dict) -> None:
        """StageAdamW's state; ``prod mu`` recomputed for the loaded step count (module doc)."""
        super().load_state_dict(sd)
        product = torch.ones((), dtype=torch.float32)
        for t in range(1, self.step_count + 1):
            product = product * momentum_cache(self.betas[0], self.lookahead.momentum_decay, t)
        self._mu_product = product
