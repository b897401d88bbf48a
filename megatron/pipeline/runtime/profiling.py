"""Profiling F / B / W for automatic Zero Bubble scheduling (``--zb-profile-iters K``).

While a :class:`~megatron.pipeline.schedules.zero_bubble.profiled.ProfiledSchedule` runs its first ``K``
(ZB-H1) iterations, every stage's :class:`OpProfiler` times its compute ops, and at the
synchronous step ending iteration ``K - 1`` a *sync hook* of the executor turns the
measurements of all stages into per-stage :class:`~megatron.pipeline.simulator.OpCosts` and
hands them to the schedule, which then decides the order of the remaining iterations.

What is measured, per stage:

* ``t_f, t_b, t_w``: wall time of each F, B and W op (``time.perf_counter``), compute only:
  the distributed executor has received an op's inputs before the op is timed and its sends
  are non-blocking. On CUDA the device is synchronised before and after each timed op (only
  while profiling). The cost is the *median* over the profiled ops of the kind: a few
  outliers (first-touch allocations in iteration 0, a preempted process on a shared host)
  do not move it; with ``K * m`` samples per kind the median is the typical op.
* ``m_w = M_W / M_B``: from the activation meter's own accounting (what the worker holds
  for a micro-batch after its B, over what its F saved), summed over the profiled Bs, so the
  scheduler's memory limit is in the units the runtime reports.
* ``t_comm``: one-way time of one activation-sized message between neighbouring stages,
  from a ping-pong (``rounds`` round trips per neighbouring pair, median round trip / 2)
  run at the synchronous step, where no pipeline message is in flight (the Zero Bubble
  reference also times a dedicated send/recv benchmark), by the transport's
  ``link_latency``: in the emulator a message is a tensor clone, so ``t_comm`` is the median
  time of cloning one activation.
  Receive wait times were not used: they measure the bubble as much as the link.

Aggregation (identical on every rank, since every rank sees the same gathered numbers):
per stage the maximum over data-parallel replicas (the slowest replica sets the pace at the
all-reduce), ``t_comm`` the maximum over all measured hops, used for every stage. Times are
converted to milliseconds and rounded to 1 µs (as the reference passes integer µs), so the
greedy's input is a short, loggable, exactly reproducible set of numbers: the logged
``zero-bubble-schedule {...}`` object saved to a file and passed as ``--zb-costs FILE`` gives
the same order again. Every rank then checks that all ranks derived the same order (a CRC of
it is all-gathered).
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from megatron.pipeline.ir import Op
from megatron.pipeline.runtime.op_profiler import SUMMARY_FIELDS, OpProfiler
from megatron.pipeline.costs.op_costs import OpCosts

if TYPE_CHECKING:
    from megatron.pipeline.runtime.transport import Transport
    from megatron.pipeline.runtime.worker import StageWorker
    from megatron.pipeline.schedules.base import Schedule
    from megatron.pipeline.schedules.zero_bubble.profiled import ProfiledSchedule


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def costs_from_summaries(summaries: Sequence[Sequence[float]], stage_of: Sequence[int], num_stages: int) -> tuple[OpCosts, ...]:
    """Per-stage costs (ms) from every rank's :meth:`OpProfiler.summary`; ``stage_of[i]`` is the
    stage of ``summaries[i]``. Deterministic: the same inputs give the same costs on every rank."""
    rows: list[list[dict[str, float]]] = [[] for _ in range(num_stages)]
    for summary, stage in zip(summaries, stage_of):
        rows[stage].append(dict(zip(SUMMARY_FIELDS, (float(x) for x in summary))))
    missing = [s for s, r in enumerate(rows) if not r or not r[0]["n_f"]]
    if missing:
        raise RuntimeError(f"no profiled ops from stage {missing[0]}")
    t_comm = _ms(max(r["t_comm"] for stage in rows for r in stage))
    return tuple(
        OpCosts(
            t_f=_ms(max(r["t_f"] for r in stage)),
            t_b=_ms(max(r["t_b"] for r in stage)),
            t_w=_ms(max(r["t_w"] for r in stage)),
            t_comm=t_comm,
            m_w=round(max(r["m_w"] for r in stage), 4),
        )
        for stage in rows
    )


def decide(schedule: "ProfiledSchedule", costs: tuple[OpCosts, ...], log: bool) -> None:
    """Hand the costs to the schedule and, on the logging rank, print the choice once."""
    schedule.set_costs(costs)
    if log:
        _print_lines(schedule.decision_lines())


def _print_lines(lines: Sequence[str]) -> None:
    for line in lines:
        print(f"[megatron-async] {line}", flush=True)


def log_choice(description: dict) -> None:
    from megatron.pipeline.schedules.zero_bubble.profiled import choice_lines

    _print_lines(choice_lines(description))


def _note_short_run(schedule: "ProfiledSchedule", log: bool) -> None:
    end = schedule.run_end  # the whole run's, not this segment's (a segment may end where profiling does)
    if log and schedule.run_start == schedule.config.first_iteration and end is not None \
            and schedule.profile_end >= end:
        print(f"[megatron-async] {schedule.name}: the {schedule.profile_iters} profiling iterations cover the "
              f"whole run ({end - schedule.run_start} iterations): every iteration runs {schedule.warmup.name}",
              flush=True)


def _due(schedule: "ProfiledSchedule", op: Op) -> bool:
    return op.sync and op.update == schedule.profile_end - 1 and not schedule.decided


# ------------------------------------------------------------------ the executors' hook


def schedule_profiling(schedule: "Schedule", transport: "Transport",
                       workers: Sequence["StageWorker"]) -> Callable[[list[Op]], None] | None:
    """Start profiling on the local workers of a schedule that profiles (its policy's
    ``profiles_ops``); return the executors'
    sync hook, which at the step ending profiling gathers every stage's measurements over
    ``transport`` and decides the order (None: nothing to profile)."""
    if not schedule.policy.profiles_ops():
        return None
    profiled: "ProfiledSchedule" = schedule  # type: ignore[assignment]
    log = transport.is_coordinator
    _note_short_run(profiled, log)
    for w in workers:
        if w.hooks.profiler is None:  # one of an earlier segment keeps its timings
            w.hooks.start_profiling(OpProfiler(w.setup.device))

    def hook(ops: list[Op]) -> None:
        if not _due(profiled, ops[0]):
            return
        rows = {}
        for w in workers:
            profiler = w.hooks.stop_profiling()
            assert profiler is not None
            setup = w.setup
            probe = torch.zeros(setup.activation_shape, dtype=setup.activation_dtype, device=setup.device)
            profiler.t_comm = transport.link_latency(probe)
            rows[w.stage] = profiler.summary()
        gathered = transport.gather_rows(rows)
        n = profiled.config.num_stages
        decide(profiled, costs_from_summaries([r for _, r in gathered], [s for s, _ in gathered], n), log=log)
        prints = {int(r[0]) for _, r in transport.gather_rows({w.stage: [profiled.fingerprint()] for w in workers})}
        if len(prints) != 1:
            raise RuntimeError(f"{profiled.name}: ranks derived different schedules from the same profile")

    return hook


def log_fixed_choice(schedule: "Schedule") -> None:
    """Log the simulated bubble of an order decided from fixed costs (zb-1p / zb-2p, no profiling),
    or the choice ``auto`` made from them."""
    from megatron.pipeline.schedules.zero_bubble.profiled import describe_choice

    start_lines = schedule.policy.start_lines()  # auto: decided from fixed costs
    if start_lines is not None:
        _print_lines(start_lines)
        return
    costs = schedule.policy.fixed_costs
    if costs is None:
        return
    try:
        log_choice(describe_choice(type(schedule), schedule.config, costs))  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - a log line must never stop training
        print(f"[megatron-async] {schedule.name}: could not describe the schedule: {exc}", file=sys.stderr)
