"""PipeMare (Yang et al., MLSys 2021): asynchronous 1F1B without weight stashing, made stable by
learning-rate rescheduling (T1), discrepancy correction (T2) and a synchronous warm-up (W).

Spec: ``../shared/specs/pipemare_amdp.md`` (next to the repository) Part A. The op streams are PACI's (1F1B without
flushes, a stage steps after its ``a`` local backwards, ``a`` = micro-batches per global batch
per replica), preceded by ``W`` iterations of 1F1B with a flush (PipeMareW). Each technique is
switched on by its own option:

* **T1** (``lr_anneal_iters = K``): stage ``i`` updates with ``lr_base(k) / tau_i ** p_k``,
  ``p_k = 1 - min(k / K, 1)`` (spec eq. 4), ``k`` the 0-based index of the update.
* **T2** (``discrepancy_decay = D``): the backward reads ``w - (tau_fwd - tau_bkwd) * delta`` with
  ``delta <- gamma * delta + (1 - gamma) * (w_{t+1} - w_t)``, ``gamma = D ** (1 / (tau_fwd - tau_bkwd))``
  (:class:`~megatron.pipeline.runtime.weight_versions.DiscrepancyCorrection`).
* **W** (``sync_warmup_iters``): the run's first ``W`` iterations are synchronous 1F1B-flush
  steps (global clipping), then asynchrony starts.

Choices where the spec is ambiguous (A.11), and why:

* ``tau_fwd`` of 0-based stage ``s`` is, by default (``delay_model = "stream"``), the delay this
  coarse 1F1B stream really has: ``ceil((N - 1 - s) / a)`` updates (PACI's drift bound, reached
  in steady state; ``N`` stages, ``a`` micro-batches per update; 0 on the last stage).
  ``delay_model = "paper"`` opts in to Table 1's fine-grained formula
  ``ceil((2 (P - i) + 1) / N)`` with ``i = s + 1`` (``P`` stages, ``N`` micro-batches per
  update), meant for pipelines that update after every micro-batch's backward at a finer
  grain; on this stream it is about twice the real delay (``[7, 5, 3, 1]`` against
  ``[3, 2, 1, 0]`` at 4 stages and ``a = 1``), so T2 would extrapolate too far.
  ``"1f1b"`` is the old name of ``"stream"`` and still accepted. ``tau_bkwd = 0`` (the
  backward reads the latest weights).
* T2 runs only on stages whose *stream* delay is at least 1, whatever the delay model: on a
  stage with no forward/backward delay (the last one) forward and backward read the same
  weights, and any extrapolation would create the mismatch T2 is meant to remove. With the
  ``stream`` model each backward extrapolates over the updates its own micro-batch really
  crossed (known exactly at run time; at most ``tau``, less while the pipeline fills and,
  with ``a > 1``, on every other micro-batch), not over ``tau``: a uniform ``tau`` moves
  backwards whose forward read the current weights, and measurably *raises* the mismatch on
  stages where ``(N - 1 - s) / a`` is not an integer.
* ``tau_i`` in T1 is ``tau_fwd,i`` (``tau_bkwd = 0``, A.2).
* T1's clock ``k`` starts when asynchrony starts (update ``W``), following the WMT wording
  ("W epochs of synchronous warm-up and another K for annealing"); warm-up updates use the
  base rate, as PipeMareW trains synchronously "using the standard learning rate".
* ``delta_0 = 0``, and ``delta`` is updated from the first update on, warm-up included, so the
  correction starts from a current velocity estimate rather than from zero; warm-up backwards
  are not corrected (there ``tau_fwd = tau_bkwd = 0``).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from megatron.pipeline.ir import Op
from megatron.pipeline.schedules.base import AsynchronousSchedule, ScheduleConfig, ScheduleConfigError
from megatron.pipeline.schedules.sync.one_f_one_b import OneFOneBFlush
from megatron.pipeline.schedules.config import ScheduleOptions, options_as
from megatron.pipeline.schedules.options import Flag, FlagGroup, OptionFields
from megatron.pipeline.schedules.asynchronous.paci import PACI, drift_bound, drift_bounds
from megatron.pipeline.schedules.policy import SchedulePolicy
from megatron.pipeline.weight_policy import COUNTED_WEIGHT_VERSIONS, DiscrepancyCorrected

DELAY_MODELS = ("stream", "paper")
DELAY_ALIASES = {"1f1b": "stream"}  # old name, kept working


@dataclass(frozen=True)
class PipeMareOptions(ScheduleOptions):
    """PipeMare's options (``ScheduleConfig.options``); None switches a technique off."""

    lr_anneal_iters: int | None = None  # T1's K
    discrepancy_decay: float | None = None  # T2's D
    sync_warmup_iters: int = 0  # PipeMareW
    delay_model: str = "stream"


def canonical_delay_model(model: str) -> str:
    """``model`` with old names mapped to their current one (``"1f1b"`` -> ``"stream"``)."""
    return DELAY_ALIASES.get(model, model)


def stage_delay(num_stages: int, stage: int, microbatches_per_update: int, model: str = "stream") -> int:
    """``tau_fwd`` of 0-indexed ``stage`` in updates (module docstring)."""
    model = canonical_delay_model(model)
    if model == "stream":
        return drift_bound(num_stages, stage, microbatches_per_update)
    if model == "paper":
        return math.ceil((2 * (num_stages - (stage + 1)) + 1) / microbatches_per_update)
    raise ValueError(f"pipemare: unknown delay model {model!r}")


@dataclass(frozen=True)
class RescheduledLR:
    """T1: ``base.lr(step) / tau ** p_k`` with ``k = step - 1 - start`` (``step`` is 1-based, as
    the worker asks ``lr(step_count + 1)``); the base rate before ``start`` and for ``tau <= 1``."""

    base: Any
    tau: int
    anneal_iters: int
    start: int = 0

    def lr(self, step: int) -> float:
        rate, k = self.base.lr(step), step - 1 - self.start
        if k < 0 or self.tau <= 1:
            return rate
        return rate / self.tau ** (1.0 - min(k / self.anneal_iters, 1.0))


def _pipemare_options(values: Mapping[str, Any], config: ScheduleConfig) -> OptionFields:
    return {"lr_anneal_iters": values["pipemare_lr_anneal_iters"],
            "discrepancy_decay": values["pipemare_discrepancy_decay"],
            "sync_warmup_iters": values["pipemare_sync_warmup_iters"],
            "delay_model": canonical_delay_model(values["pipemare_delay_model"])}


def pipemare_tau(config: ScheduleConfig, stage: int) -> int:
    """``tau`` of ``stage`` under the configured delay model (module docstring)."""
    options = options_as(config.options, PipeMareOptions)
    return stage_delay(config.num_stages, stage, config.num_microbatches, options.delay_model)


def _corrects(config: ScheduleConfig, stage: int) -> bool:
    """T2 is on and the stage's stream really has a forward/backward delay (never the last stage)."""
    return (options_as(config.options, PipeMareOptions).discrepancy_decay is not None
            and pipemare_tau(config, stage) >= 1 and drift_bound(config.num_stages, stage, config.num_microbatches) >= 1)


def _weight_policy(config: ScheduleConfig, stage: int) -> DiscrepancyCorrected | None:
    """T2's correction on a stage it corrects (the delta is one more weight-sized buffer)."""
    opts = options_as(config.options, PipeMareOptions)
    if not _corrects(config, stage):
        return None
    assert opts.discrepancy_decay is not None
    return DiscrepancyCorrected(pipemare_tau(config, stage), opts.discrepancy_decay, config.num_microbatches,
                                sync_until=opts.sync_warmup_iters,
                                measured_delay=canonical_delay_model(opts.delay_model) == "stream")


def pipemare_policy(config: ScheduleConfig) -> SchedulePolicy:
    """T1 rescales each stage's learning rate (:class:`RescheduledLR`); T2 corrects the weights its
    backwards read, from a delta that is weight-policy state a checkpoint saves. The streams are
    PACI's, so are the gradients' delays."""
    opts = options_as(config.options, PipeMareOptions)
    stages = range(config.num_stages)
    stage_lr = tuple(
        None if opts.lr_anneal_iters is None else
        functools.partial(RescheduledLR, tau=pipemare_tau(config, s), anneal_iters=opts.lr_anneal_iters,
                          start=opts.sync_warmup_iters)
        for s in stages)
    return dataclasses.replace(SchedulePolicy.plain(config.layout),
                               weight_copies=tuple(2 if _corrects(config, s) else 1 for s in stages),
                               weight_policies=tuple(_weight_policy(config, s) for s in stages),
                               stage_lr=stage_lr, weight_policy_has_state=True,
                               fixed_accumulation=COUNTED_WEIGHT_VERSIONS, gradient_delays=drift_bounds(config))


#: Each technique has its own flag and is off without it.
PIPEMARE_FLAGS = FlagGroup("PipeMare techniques", (
    Flag("--pipemare-lr-anneal-iters", type=int, metavar="K",
         help="T1: stage i updates with lr / tau_i^(1 - min(k/K, 1)) (k: update since asynchrony began)"),
    Flag("--pipemare-discrepancy-decay", type=float, metavar="D",
         help="T2: backwards read w - d * delta (d: the updates the micro-batch crossed since its forward, "
              "tau_i with --pipemare-delay-model paper; never on a zero-delay stage), delta an EMA of the "
              "per-update weight change with decay D^(1/tau_i); the paper suggests D near 0.1-0.5"),
    Flag("--pipemare-sync-warmup-iters", type=int, default=0, metavar="W",
         help="PipeMareW: the first W iterations run synchronously (1F1B with a flush)"),
    Flag("--pipemare-delay-model", choices=(*DELAY_MODELS, *DELAY_ALIASES), default="stream",
         help="tau of 0-based stage s: 'stream' (default) is this 1F1B stream's real delay "
              "ceil((N-1-s)/a) (N stages, a micro-batches per update; 0 on the last stage); "
              "'paper' is Table 1's fine-grained ceil((2(N-s)-1)/a), about twice as long here; "
              "'1f1b' is the old name of 'stream'. T2 never corrects a stage whose stream delay is 0"),
), _pipemare_options)


class PipeMare(PACI):
    name = "pipemare"
    traits = dataclasses.replace(PACI.traits, flag_groups=(PIPEMARE_FLAGS,), options=PipeMareOptions,
                                 policy_for=pipemare_policy)

    @staticmethod
    def options(config: ScheduleConfig) -> PipeMareOptions:
        return options_as(config.options, PipeMareOptions)

    @classmethod
    def check_config(cls, config: ScheduleConfig) -> None:
        super().check_config(config)
        opts = cls.options(config)
        if opts.lr_anneal_iters is not None and opts.lr_anneal_iters < 1:
            raise ScheduleConfigError(f"pipemare: T1's annealing length K must be >= 1, got {opts.lr_anneal_iters}")
        if opts.discrepancy_decay is not None and not 0.0 < opts.discrepancy_decay < 1.0:
            raise ScheduleConfigError(f"pipemare: T2's decay D must be in (0, 1), got {opts.discrepancy_decay}")
        if opts.sync_warmup_iters < 0:
            raise ScheduleConfigError(f"pipemare: synchronous warm-up iterations must be >= 0, got {opts.sync_warmup_iters}")
        if canonical_delay_model(opts.delay_model) not in DELAY_MODELS:
            raise ScheduleConfigError(f"pipemare: delay model {opts.delay_model!r} is not one of {', '.join(DELAY_MODELS)}")

    @classmethod
    def tau(cls, config: ScheduleConfig, stage: int) -> int:
        return pipemare_tau(config, stage)

    def stage_ops(self, stage: int) -> Iterator[Op]:
        """``W`` synchronous 1F1B iterations (counted from the run's iteration 0), then PACI's stream."""
        cfg = self.config
        end = None if cfg.num_iterations is None else cfg.first_iteration + cfg.num_iterations
        sync_end = max(cfg.first_iteration, self.options(cfg).sync_warmup_iters)
        if end is not None:
            sync_end = min(sync_end, end)
        if sync_end > cfg.first_iteration:
            warmup = dataclasses.replace(cfg, num_iterations=sync_end - cfg.first_iteration, options=ScheduleOptions())
            yield from OneFOneBFlush(warmup).stage_ops(stage)
        if end is not None and sync_end >= end:
            return
        rest = copy.copy(self)
        rest.config = dataclasses.replace(cfg, first_iteration=sync_end,
                                          num_iterations=None if end is None else end - sync_end)
        yield from AsynchronousSchedule.stage_ops(rest, stage)
