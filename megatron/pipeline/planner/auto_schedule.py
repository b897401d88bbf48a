"""``--pipeline-schedule auto`` / ``auto-async``: profile, then run the schedule the planner ranks first.

Registered as selectors (:func:`megatron.pipeline.schedules.register_selector`) by
:func:`register_auto_selectors`, which the trainer's argument parser calls: the schedules
package cannot import the planner, which ranks with the schedules.

Why it is a profiled schedule: the run's first ``K = --zb-profile-iters`` iterations run ZB-H1
while the executors time every F, B and W exactly as for zb-1p / zb-2p
(:class:`~megatron.pipeline.schedules.zero_bubble.profiled.ProfiledSchedule`, whose machinery this reuses:
the sync hook of :mod:`megatron.pipeline.runtime.profiling`, the cost aggregation, the
every-rank fingerprint check, the checkpointed decision). At the synchronous step ending
iteration ``K - 1`` (a drained boundary: every stage has stepped, nothing is in flight) the
planner ranks every schedule the built stages can switch to
(:mod:`megatron.pipeline.planner.runtime_choice`) by simulated time with those costs, within
the activation-memory limit (``--zb-memory-limit`` in ``M_B``, else the limit the trainer
derived from the device's memory, else none), and iterations ``K ..`` run the winner. With
``--zb-costs`` the decision is made at construction, from those costs, and no iteration
profiles.

Losses unchanged: ``auto`` chooses among synchronous schedules only, and every one of them
computes each iteration exactly as 1F1B (each stage's backward passes in micro-batch order, B
+ W exact per micro-batch; ``tests/test_zero_bubble_runtime.py``), so the run's numbers equal
those of the chosen schedule run from the start, bit for bit (``tests/test_auto_schedule.py``).
``auto-async`` may choose an asynchronous schedule (PACI); its iterations ``K ..`` are then that
schedule's stream from iteration ``K``, a synchronous warm-up of ``K`` iterations followed by
stale updates, which is not the asynchronous schedule run from the start.

Another layout: the trainer may hand ``auto`` layouts it can rebuild the run in
(``relayouts``, with the chain's ``stage_layers``; :mod:`megatron.pipeline.planner.relayout`):
the V schedules, interleaving. They are ranked beside the chain's schedules; one wins only by
more than :data:`~megatron.pipeline.planner.decide.RELAYOUT_MARGIN` over the best the chain runs (a rebuild costs a checkpoint's
round trip). When one wins, the stream ends at the decision boundary (``relayout`` says where
to), and the trainer rebuilds its stages in that layout through a checkpoint that reshards by
parameter name and runs the chosen schedule from there: the numbers are those of a run saved
at the boundary and resumed with the chosen schedule, equal to the chain's up to the order of
floating-point sums that the new placement changes (the tied embedding's two gradients now on
one stage).

The decision is stored in checkpoints (costs, where profiling ended, the chosen name), so a
resumed run keeps the schedule it chose, even if a later version of the planner would rank
differently.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from megatron.pipeline.ir import OPT, Op
from megatron.pipeline.planner.relayout import Relayout
from megatron.pipeline.planner.decide import RELAYOUT_MARGIN, Candidates, Limits, decide, pick  # noqa: F401  (re-exported)
from megatron.pipeline.planner.runtime_choice import choice_table
from megatron.pipeline.schedules import register_selector, schedule_class
from megatron.pipeline.schedules.base import Schedule, ScheduleConfig, ScheduleConfigError
from megatron.pipeline.schedules.config import ScheduleOptions, options_as
from megatron.pipeline.schedules.policy import SchedulePolicy
from megatron.pipeline.schedules.zero_bubble.profiled import PLACEHOLDER_COSTS, CostsNotProfiled, ProfiledSchedule
from megatron.pipeline.schedules.zero_bubble.zb_1p import ZB1P
from megatron.pipeline.schedules.zero_bubble.flags import (ZERO_BUBBLE_FLAGS, ZeroBubbleOptions, memory_limited,
                                                           with_order_costs)
from megatron.pipeline.costs.op_costs import CostsLike, OpCosts, stage_costs

#: the line every decision starts with (scripts look for it)
CHOICE_PREFIX = "auto: chose "


@dataclass(frozen=True)
class AutoOptions(ZeroBubbleOptions):
    """``auto``'s options: Zero Bubble's (its profiling, costs and memory limit) and what the
    trainer sets for the ranking.

    ``host_cores``: the cores one pipeline's CPU ranks share when they outnumber them (every rank
    the same value, so every rank makes the same choice). ``relayouts``: the layouts the trainer
    can rebuild the run in (:class:`Relayout`s), priced with the chain's ``stage_layers`` (layers
    per stage). ``stage_activation_bytes``: the chain's activation bytes of one micro-batch per
    stage (a memory limit's unit on each stage, to hold a rebuilt layout to it).
    """

    host_cores: int | None = None
    relayouts: tuple[Relayout, ...] = ()
    stage_layers: tuple[int, ...] = ()
    stage_activation_bytes: tuple[float, ...] = ()


def auto_options(options: ScheduleOptions) -> AutoOptions:
    """``options`` as ``auto``'s (what the trainer sets for the ranking at their defaults when
    the run's schedule is another one)."""
    return options_as(options, AutoOptions)


def _build(name: str, config: ScheduleConfig) -> Schedule:
    return schedule_class(name)(config)


#: the rule's old name (tests and callers): :func:`~megatron.pipeline.planner.decide.pick`
_pick = pick


class AutoSchedule(ProfiledSchedule):
    """Profiled ZB-H1 iterations, then the fastest fitting synchronous schedule (module docstring)."""

    name = "auto"
    include_async: ClassVar[bool] = False
    traits = dataclasses.replace(ProfiledSchedule.traits, options=AutoOptions,
                                 flag_groups=(*ProfiledSchedule.traits.flag_groups, ZERO_BUBBLE_FLAGS))

    def __init__(self, config: ScheduleConfig):
        options = auto_options(config.options)
        self.limit: float | None = options.memory_limit
        fixed = None if options.profile_iters else (PLACEHOLDER_COSTS if options.costs is None else options.costs)
        #: ranked with PLACEHOLDER_COSTS (--zb-profile-iters 0 without --zb-costs): nothing measured
        self.placeholder_costs = fixed is PLACEHOLDER_COSTS
        if fixed is None:
            self._init_profiled(config)
        else:  # --zb-costs (or --zb-profile-iters 0): decide now, profile nothing
            Schedule.__init__(self, config)
            self.target_class, self.profile_iters, self.costs, self.target = ZB1P, 0, None, None
            self._restored_profile_end = None
        self.name = type(self).name  # type: ignore[misc]
        self.choice: dict[str, Any] | None = None
        if fixed is not None:
            self.set_costs(fixed)

    def _init_profiled(self, config: ScheduleConfig) -> None:
        """ProfiledSchedule's set-up with zb-1p as the warm-up's fallback: ZB-H1, or below its
        ``N M_B`` the greedy's order for placeholder costs (which stays within the limit)."""
        options = auto_options(config.options)
        if options.memory_limit is None:
            options = dataclasses.replace(options, memory_limit=float(config.num_stages))
        super().__init__(ZB1P, dataclasses.replace(config, options=options))
        self.config = config

    @classmethod
    def check_config(cls, config: ScheduleConfig) -> None:
        super(ProfiledSchedule, cls).check_config(config)
        if config.num_chunks != 1:
            raise ScheduleConfigError(f"{cls.name}: chooses among one-chunk schedules; drop "
                                      "--num-layers-per-virtual-pipeline-stage")

    # -- the decision ----------------------------------------------------------------------
    def set_costs(self, costs: CostsLike, chosen: str | None = None) -> None:
        """Rank the switchable schedules with ``costs`` and take the best (or ``chosen``, a
        checkpoint's decision)."""
        if self.target is not None:
            raise RuntimeError(f"{self.name}: costs were already set")
        per_stage = stage_costs(costs, self.config.num_stages)
        base = dataclasses.replace(self.config, first_iteration=self.run_start, options=ScheduleOptions())
        options = auto_options(self.config.options)
        candidates = Candidates(base, self.include_async, options.relayouts, options.stage_layers,
                                options.stage_activation_bytes)
        try:
            decision = decide(per_stage, candidates, Limits(self.limit, options.host_cores), chosen)
        except ScheduleConfigError as exc:
            raise ScheduleConfigError(f"{self.name}: {exc}") from None
        best = decision.best
        if best.relayout is None:
            kind = schedule_class(best.schedule).traits.options
            options = with_order_costs(memory_limited(kind, self.limit), kind, per_stage)
            self.target = _build(best.schedule, dataclasses.replace(base, options=options))  # type: ignore[assignment]
        else:  # the schedule as the rebuilt run will order it (its order line and fingerprint)
            self.target = _build(best.schedule, best.candidate(base).config(  # type: ignore[assignment]
                base.num_iterations or 1, best.relayout.options, base.data_parallel_size))
        self.costs = per_stage
        self.choice = {"best": best, "ranked": list(decision.ranked), "refused": list(decision.refused)}

    @property
    def relayout(self) -> Relayout | None:
        """The layout the trainer rebuilds the run in at :attr:`profile_end` (None: none, the
        run's chain runs the choice, or no choice yet)."""
        return None if self.choice is None else self.choice["best"].relayout

    def decision_lines(self) -> list[str]:
        """``auto: chose SCHEDULE`` with the micro-batch order and the reason, then the table."""
        if self.choice is None or self.target is None:
            raise CostsNotProfiled(f"{self.name}: no schedule chosen yet")
        best, ranked = self.choice["best"], self.choice["ranked"]
        where = (f"profiled over iterations 1-{self.profile_iters}" if self.profile_iters
                 else "placeholder F = B = W (--zb-profile-iters 0 and no --zb-costs: nothing measured, "
                      "so the order only follows the stage count)" if self.placeholder_costs
                 else "fixed by --zb-costs")
        runner_up = next((c for c in ranked[1:] if c.iteration_time > best.iteration_time), None)
        margin = (f"{runner_up.schedule} {runner_up.iteration_time:.3f}" if runner_up is not None
                  else "no slower candidate")
        limit = "no memory limit" if self.limit is None else f"memory limit {self.limit:g} M_B"
        reason = (f"fastest of {len(ranked)} fitting {'' if self.include_async else 'synchronous '}schedules "
                  f"with costs {where}: simulated iteration {best.iteration_time:.3f} (next: {margin}), "
                  f"peak {max(best.peak):.2f} M_B, {limit}")
        if self.config.num_stages == 1:
            reason += ("; one stage: no pipeline bubble to remove, every schedule takes the same time "
                       "(the first of the tie runs)")
        first = self.profile_end
        rebuilt = "" if best.relayout is None else f" (stages rebuilt as {best.relayout.label})"
        return [f"{CHOICE_PREFIX}{best.schedule}{rebuilt} from iteration {first}; order {self.order_text()}; "
                f"reason: {reason}", *choice_table(ranked), *(f"auto: not run: {r}" for r in self.choice["refused"]),
                f"auto-schedule {json.dumps(self.describe())}"]  # as a file, --zb-costs reads its costs

    def order_text(self) -> str:
        """One iteration's op order of the first and the last stage (micro-batches 0..m-1)."""
        m, n = self.config.num_microbatches, self.config.num_stages
        target = self.target
        assert target is not None
        if target.traits.asynchronous:
            return f"{target.name}'s steady stream (stage-local steps every {m} micro-batches)"
        stages = sorted({0, n - 1})
        return " | ".join(f"s{s}: " + " ".join(f"{op.kind.value}{op.microbatch}"
                                               for op in target.iteration_ops(s, range(m))) for s in stages)

    def describe(self) -> dict[str, Any]:
        if self.choice is None or self.costs is None:
            raise CostsNotProfiled(f"{self.name}: no schedule chosen yet")
        best = self.choice["best"]
        return {"schedule": best.schedule, "relayout": None if best.relayout is None else best.relayout.label,
                "iteration_time": best.iteration_time, "peak": list(best.peak),
                "memory_limit": self.limit, "profile_iters": self.profile_iters,
                "costs": [dataclasses.asdict(c) for c in self.costs],
                "ranked": [c.schedule for c in self.choice["ranked"]]}

    def fingerprint(self) -> int:
        """CRC32 of the chosen schedule's first iteration on every stage."""
        if self.target is None:
            raise CostsNotProfiled(f"{self.name}: no schedule chosen yet")
        m = self.config.num_microbatches
        if self.target.traits.asynchronous:
            return zlib.crc32(self.target.name.encode())
        return zlib.crc32(repr([list(self.target.iteration_ops(s, range(m)))  # type: ignore[attr-defined]
                                for s in range(self.config.num_stages)]).encode())

    @functools.cached_property
    def policy(self) -> SchedulePolicy:
        """The profiled policy, with the decision's lines for the start (no fixed costs: the
        start logs :meth:`start_lines` instead, profiling.log_fixed_choice)."""
        return dataclasses.replace(super().policy, start_lines=self.start_lines)

    def start_lines(self) -> list[str]:
        """What the start logs: the decision when it was made from fixed costs, else nothing."""
        return self.decision_lines() if self.decided and not self.profile_iters else []

    # -- checkpoints -------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any] | None:
        state = super().checkpoint_state()
        if state is not None and self.choice is not None:
            state["schedule"] = self.choice["best"].label
            state["relayout"] = self.describe()["relayout"]
        return state

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Keep the checkpoint's choice (an ``auto`` run resumed with ``--zb-costs`` too: the
        run chose once)."""
        self.target, self.choice = None, None
        self.set_costs(tuple(OpCosts.from_dict(c) for c in state["costs"]), chosen=state.get("schedule"))
        self._restored_profile_end = int(state["profile_end"])

    # -- stream --------------------------------------------------------------------------
    def stage_ops(self, stage: int) -> Iterator[Op]:
        if self.policy.post_validated:
            return super().stage_ops(stage)
        return self._switching_ops(stage)

    def _switching_ops(self, stage: int) -> Iterator[Op]:
        """Synchronous iterations up to the decision, then the chosen schedule's stream (an
        asynchronous one from there on, as its own segment)."""
        m, its = self.config.num_microbatches, self.config.iterations
        for it in its:
            if it >= self.profile_end and self.relayout is not None:
                return  # the trainer rebuilds the stages here (module docstring)
            if it >= self.profile_end and self.target is not None and self.target.traits.asynchronous:
                yield from self.target.segment(it, its.stop - it).stage_ops(stage)
                return
            yield from self.iteration_ops(stage, range(it * m, (it + 1) * m))
            yield OPT(stage, it, sync=True)


class AutoAsyncSchedule(AutoSchedule):
    """``auto`` that may also choose an asynchronous schedule (stale weights, no flush)."""

    name = "auto-async"
    include_async = True
    traits = dataclasses.replace(AutoSchedule.traits, may_become_asynchronous=True)

    @classmethod
    def check_config(cls, config: ScheduleConfig) -> None:
        super().check_config(config)
        if auto_options(config.options).post_validation:
            raise ScheduleConfigError(f"{cls.name}: optimizer post-validation needs a synchronous step in "
                                      "every iteration; use auto")


#: the selectors this module defines, registered by :func:`register_auto_selectors`
AUTO_SELECTORS: tuple[type[AutoSchedule], ...] = (AutoSchedule, AutoAsyncSchedule)


def register_auto_selectors() -> None:
    """Make ``auto`` and ``auto-async`` valid ``--pipeline-schedule`` names. Called by whoever
    offers them (the trainer's parser); idempotent."""
    for selector in AUTO_SELECTORS:
        register_selector(selector)
