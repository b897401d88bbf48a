"""Profiled automatic Zero Bubble scheduling: ZB-1p / ZB-2p from costs measured in the run.

Zero Bubble (Qi et al., §3.1 and App. G; spec §9.1-9.2) feeds the scheduling heuristic with
``T_F, T_B, T_W, T_comm`` profiled during the first iterations of the real run; before that a
fixed schedule runs. :class:`ProfiledSchedule` is that, as a lazy stream:

* iterations ``0 .. K-1`` (``K = ZeroBubbleOptions.profile_iters``) run ZB-H1, which splits B/W like
  the target and needs no costs, while the executors time every F, B and W
  (:mod:`megatron.pipeline.runtime.profiling`); with a memory limit below ZB-H1's ``N M_B`` they run
  the target's order for placeholder costs instead;
* at the synchronous optimizer step that ends iteration ``K - 1`` the executor gathers the
  per-stage measurements from all ranks and calls :meth:`ProfiledSchedule.set_costs`; every
  rank computes the same costs from the same gathered numbers and the greedy is
  deterministic, so every stage derives the same order;
* iterations ``K ..`` run the target schedule (ZB-1p or ZB-2p, with ``ZeroBubbleOptions.memory_limit``
  if given) built from those costs.

The stream asks for the costs only when the stage's generator is advanced past that step,
which both executors do only after the step ran (the distributed executor's receive
prefetch stops at a synchronous step; the replay engine pulls the next op after the
collective). A stream advanced further without costs raises.

The math of every iteration is the same as 1F1B's: F, B and W of a micro-batch are
exact, and both ZB-H1 and the greedy run each stage's B passes and W passes in micro-batch
order, so gradients accumulate in the same order; only the timing (and the memory in flight)
changes.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import zlib
from collections.abc import Iterator
from typing import Any

from megatron.pipeline.ir import Op
from megatron.pipeline.schedules.base import ScheduleConfig, ScheduleConfigError, SynchronousSchedule
from megatron.pipeline.schedules.config import ScheduleOptions, options_as
from megatron.pipeline.schedules.policy import CheckpointCodec, SchedulePolicy
from megatron.pipeline.schedules.sync.one_f_one_b import OneFOneBFlush
from megatron.pipeline.schedules.zero_bubble.zb_1p import ZB1P, ZeroBubbleAuto
from megatron.pipeline.schedules.zero_bubble.zb_2p import ZB2P
from megatron.pipeline.schedules.zero_bubble.flags import ZeroBubbleOptions
from megatron.pipeline.schedules.zero_bubble.zb_h1 import ZBH1
from megatron.pipeline.schedules.v_shape.v_half import VHalf
from megatron.pipeline.schedules.v_shape.zb_v import ZBV
from megatron.pipeline.costs.op_costs import UNPROFILED_M_W, CostsLike, OpCosts, stage_costs
from megatron.pipeline.simulator import simulate_schedule

# Before profiling: all times 1, no communication, and W keeping a micro-batch's activations
# whole (M_W = M_B), the most it can keep. Memory after any prefix of a stage's ops is
# (#F - #B) M_B + (#B - #W) M_W, which grows with M_W, so an order within the limit at
# M_W = M_B is within it for the real ratio too.
PLACEHOLDER_COSTS = OpCosts(m_w=UNPROFILED_M_W)


class CostsNotProfiled(RuntimeError):
    """A profiled schedule's stream was advanced past the profiling iterations without costs."""


#: what the profiling iterations run for each target: a schedule of the target's layout that
#: splits B/W and needs no costs (ZB-H1 on a chain; on a V, V-Half's building block)
WARMUP: dict[type[SynchronousSchedule], type[SynchronousSchedule]] = {ZB1P: ZBH1, ZB2P: ZBH1, ZBV: VHalf}
Target = ZeroBubbleAuto | ZBV


class ProfiledSchedule(SynchronousSchedule):
    """``K`` warm-up iterations (:data:`WARMUP`), then ``target`` (zb-1p, zb-2p or zb-v) from
    profiled costs."""

    name = "profiled"  # replaced per instance by the target's name
    traits = dataclasses.replace(SynchronousSchedule.traits, options=ZeroBubbleOptions)

    def __init__(self, target: type[Target], config: ScheduleConfig):
        if target not in WARMUP:
            raise ScheduleConfigError(
                f"{getattr(target, 'name', target)}: profiled costs apply to zb-1p, zb-2p and zb-v only")
        self.name = target.name  # type: ignore[misc]  # instance attribute: messages, logs
        target.check_config(config)
        super().__init__(config)
        self.target_class = target
        self.layout = target.traits.layout_of(config)
        self.profile_iters = options_as(config.options, ZeroBubbleOptions).profile_iters
        if self.profile_iters < 1:
            raise ScheduleConfigError(f"{self.name}: profiling needs at least one iteration, got {self.profile_iters}")
        self.costs: tuple[OpCosts, ...] | None = None
        self.target: Target | None = None
        self._restored_profile_end: int | None = None  # set when a checkpoint hands back the decision
        # Fails now, not at iteration K, if the memory limit cannot hold any order.
        placeholder = self._build_target(PLACEHOLDER_COSTS)
        self.memory_limit = placeholder.memory_limit
        # The warm-up's peak at M_W = M_B (ZB-H1: N M_B; V-Half: (N+2)//2 whole stages) bounds it
        # for any real ratio; below the limit the profiling iterations run the target's order
        # for the placeholder costs instead, which respects it (see PLACEHOLDER_COSTS).
        warmup = WARMUP[target](config)
        peak = max(simulate_schedule(warmup.segment(config.first_iteration, 1), PLACEHOLDER_COSTS).peak_memory)
        self.warmup: SynchronousSchedule = warmup if peak <= self.memory_limit + 1e-9 else placeholder

    @property
    def synchronous_iterations(self) -> int:
        """The run's first K (profiling) iterations keep the synchronous step under post-validation."""
        return self.run_start + self.profile_iters

    @functools.cached_property
    def policy(self) -> SchedulePolicy:
        """The synchronous policy on the target's layout, with the decision as checkpoint state
        and the ops timed until it is made."""
        return dataclasses.replace(super().policy, layout=self.layout, profiles_ops=self.profiles_ops,
                                   checkpoint=CheckpointCodec(self.checkpoint_state, self.restore_checkpoint_state))

    # -- costs ---------------------------------------------------------------------------
    def _build_target(self, costs: CostsLike) -> Target:
        options = dataclasses.replace(options_as(self.config.options, ZeroBubbleOptions), profile_iters=0, costs=costs)
        return self.target_class(dataclasses.replace(self.config, options=options))

    def set_costs(self, costs: CostsLike) -> None:
        """Decide the order of iterations ``K ..`` from ``costs`` (once; normally profiled)."""
        if self.target is not None:
            raise RuntimeError(f"{self.name}: costs were already set")
        per_stage = stage_costs(costs, self.config.num_stages)
        self.target = self._build_target(per_stage)
        self.costs = per_stage

    @property
    def profile_end(self) -> int:
        """First global iteration after profiling: the run's first K iterations profile. A run
        resumed from a checkpoint saved after the decision keeps the original run's value
        (:meth:`restore_checkpoint_state`); one saved before it profiles again from its start."""
        if self._restored_profile_end is not None:
            return self._restored_profile_end
        return self.run_start + self.profile_iters

    # -- checkpoints ---------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any] | None:
        """The decision (costs and where profiling ended), so a resumed run keeps the same order;
        None before the decision."""
        if self.costs is None:
            return None
        return {"profile_end": self.profile_end, "costs": [dataclasses.asdict(c) for c in self.costs]}

    def restore_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Take a decision saved by :meth:`checkpoint_state`: the same costs give the same greedy
        order (the greedy is deterministic), and profiling is not repeated."""
        self.set_costs(tuple(OpCosts.from_dict(c) for c in state["costs"]))
        self._restored_profile_end = int(state["profile_end"])

    @property
    def decided(self) -> bool:
        return self.target is not None

    def profiles_ops(self) -> bool:
        return not self.decided  # a later segment of the run, or a resumed one, knows the order

    def fingerprint(self) -> int:
        """CRC32 of the decided order, to check that every rank derived the same one."""
        if self.target is None:
            raise CostsNotProfiled(f"{self.name}: no order decided yet")
        return zlib.crc32(repr(getattr(self.target.plan, "order", self.target.plan)).encode())

    def describe(self) -> dict[str, Any]:
        """Costs and the simulated iteration of the decided order next to ZB-H1's (one iteration)."""
        if self.target is None or self.costs is None:
            raise CostsNotProfiled(f"{self.name}: no order decided yet")
        return describe_choice(self.target_class, self.config, self.costs, self.profile_iters)

    def decision_lines(self) -> list[str]:
        """What the logging rank prints once the order is decided."""
        return choice_lines(self.describe())

    # -- stream --------------------------------------------------------------------------
    def iteration_ops(self, stage: int, microbatches: range) -> Iterator[Op]:
        iteration = microbatches.start // self.config.num_microbatches
        if iteration < self.profile_end:
            return self.warmup.iteration_ops(stage, microbatches)
        if self.target is None:
            raise CostsNotProfiled(
                f"{self.name}: stage {stage} reached iteration {iteration} but no profiled costs were "
                f"set at the synchronous step ending iteration {self.profile_end - 1}")
        return self.target.iteration_ops(stage, microbatches)


def one_iteration(config: ScheduleConfig, options: ScheduleOptions) -> ScheduleConfig:
    return ScheduleConfig(config.num_stages, config.num_microbatches, 1, options=options)


def describe_choice(
    target: type[Target], config: ScheduleConfig, costs: tuple[OpCosts, ...], profile_iters: int = 0
) -> dict[str, Any]:
    """What the log line reports: per-stage costs, the memory limit and one simulated iteration
    of the chosen order and of ZB-H1 and 1F1B (makespan, bubble rate, peak memory in M_B)."""
    base = options_as(config.options, ZeroBubbleOptions)
    chosen = target(one_iteration(config, dataclasses.replace(base, profile_iters=0, costs=costs)))
    out: dict[str, Any] = {
        "schedule": target.name,
        "num_stages": config.num_stages,
        "num_microbatches": config.num_microbatches,
        "profile_iters": profile_iters,
        "costs": [dataclasses.asdict(c) for c in costs],
        "memory_limit": chosen.memory_limit,
        "greedy_options": list(getattr(chosen.plan, "options", ())),
    }
    for key, schedule in (("chosen", chosen),
                          (ZBH1.name, ZBH1(one_iteration(config, ScheduleOptions()))),
                          (OneFOneBFlush.name, OneFOneBFlush(one_iteration(config, ScheduleOptions())))):
        result = simulate_schedule(schedule, costs)
        out[key] = {"makespan": result.makespan, "cost": result.cost, "bubble_rate": result.bubble_rate,
                    "peak_memory": result.peak_memory}
    return out


def format_choice(d: dict[str, Any], unit: str = "ms") -> str:
    """One human-readable line of :func:`describe_choice`."""
    stages = "; ".join(
        f"s{s}: F {c['t_f']:.3f} B {c['t_b']:.3f} W {c['t_w']:.3f} M_W/M_B {c['m_w']:.2f}"
        for s, c in enumerate(d["costs"]))
    where = (f"profiled over iterations 1-{d['profile_iters']}" if d["profile_iters"]
             else "fixed (--zb-costs or defaults)")
    chosen, h1 = d["chosen"], d["zb-h1"]
    return (
        f"{d['schedule']}: costs {where} ({unit}) {stages}; T_comm {d['costs'][0]['t_comm']:.3f}; "
        f"memory limit {d['memory_limit']:g} M_B; simulated iteration {chosen['makespan']:.3f} {unit}, "
        f"bubble rate {chosen['bubble_rate']:.4f}, peak {max(chosen['peak_memory']):.2f} M_B "
        f"(zb-h1: {h1['makespan']:.3f} {unit}, bubble rate {h1['bubble_rate']:.4f}; "
        f"1f1b: bubble rate {d['1f1b']['bubble_rate']:.4f})"
    )


def choice_lines(description: dict[str, Any]) -> list[str]:
    """The log lines of a decided order: readable, then the ``zero-bubble-schedule {...}`` object
    (``--zb-costs`` reads it back)."""
    return [format_choice(description), f"zero-bubble-schedule {json.dumps(description)}"]


def schedule_from_choice(description: dict[str, Any], num_iterations: int = 1) -> Target:
    """The order a profiled run decided, rebuilt from what it logged (:func:`describe_choice`,
    the ``zero-bubble-schedule {...}`` line): the same costs and memory limit give the same
    greedy order, so benchmarks can simulate exactly the schedule that ran."""
    target = {cls.name: cls for cls in WARMUP}[description["schedule"]]
    costs = tuple(OpCosts.from_dict(c) for c in description["costs"])
    config = ScheduleConfig(description["num_stages"], description["num_microbatches"], num_iterations,
                            options=ZeroBubbleOptions(costs=costs, memory_limit=description["memory_limit"]))
    schedule = target(config)
    assert isinstance(schedule, (ZeroBubbleAuto, ZBV)), description["schedule"]
    return schedule
