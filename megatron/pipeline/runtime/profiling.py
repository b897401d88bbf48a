"""Profiling F / B / W for automatic Zero Bubble scheduling (``--zb-profile-iters K``).

While a :class:`~megatron.pipeline.schedules.profiled.ProfiledSchedule` runs its first ``K``
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
  reference also times a dedicated send/recv benchmark). In the emulator a message is a
  tensor clone, so ``t_comm`` is the median time of cloning one activation.
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

import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from megatron.pipeline.ir import Op, OpKind
from megatron.pipeline.runtime.memory import ActivationMeter
from megatron.pipeline.simulator import OpCosts

if TYPE_CHECKING:
    from megatron.pipeline.runtime.parallel import StageGroups
    from megatron.pipeline.schedules.profiled import ProfiledSchedule
    from megatron.pipeline.runtime.worker import StageWorker

_TIMED = (OpKind.F, OpKind.B, OpKind.W)
# The fixed-length summary a rank contributes to the all-gather (seconds, ratio, counts).
SUMMARY_FIELDS = ("t_f", "t_b", "t_w", "m_w", "t_comm", "n_f", "n_b", "n_w")
PING_ROUNDS = 5


class OpProfiler:
    """Wall times of one stage's F / B / W ops and the M_W / M_B ratio of its Bs."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: dict[OpKind, list[float]] = {k: [] for k in _TIMED}
        self.bytes_forward = 0  # what the profiled Bs' micro-batches held before B (their F's)
        self.bytes_kept = 0  # what they still held after B, for W
        self.t_comm = 0.0  # set by the executor's hook (ping-pong or clone time)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def timed(self, op: Op, meter: ActivationMeter) -> Iterator[None]:
        if op.kind not in self.times:
            yield
            return
        key = (op.microbatch, op.chunk)
        before = meter.live_bytes(key)
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.times[op.kind].append(time.perf_counter() - start)
        if op.kind is OpKind.B:
            self.bytes_forward += before
            self.bytes_kept += meter.live_bytes(key)

    def summary(self) -> list[float]:
        """This stage's measurements in :data:`SUMMARY_FIELDS` order (seconds)."""
        med = {k: statistics.median(v) if v else 0.0 for k, v in self.times.items()}
        m_w = self.bytes_kept / self.bytes_forward if self.bytes_forward else 0.0
        return [med[OpKind.F], med[OpKind.B], med[OpKind.W], min(1.0, m_w), self.t_comm,
                float(len(self.times[OpKind.F])), float(len(self.times[OpKind.B])), float(len(self.times[OpKind.W]))]


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
        log_choice(schedule.describe())


def log_choice(description: dict) -> None:
    from megatron.pipeline.schedules.profiled import format_choice

    print(f"[megatron-async] {format_choice(description)}", flush=True)
    print(f"[megatron-async] zero-bubble-schedule {json.dumps(description)}", flush=True)


def _note_short_run(schedule: "ProfiledSchedule", log: bool) -> None:
    total = schedule.config.num_iterations
    if log and schedule.run_start == schedule.config.first_iteration and total is not None \
            and schedule.profile_iters >= total:
        print(f"[megatron-async] {schedule.name}: the {schedule.profile_iters} profiling iterations cover the "
              f"whole run ({total} iterations): every iteration runs zb-h1", flush=True)


def _due(schedule: "ProfiledSchedule", op: Op) -> bool:
    return op.sync and op.update == schedule.profile_end - 1 and not schedule.decided


# ------------------------------------------------------------------ emulator


def measure_clone(worker: "StageWorker", rounds: int = PING_ROUNDS) -> float:
    """Median time to clone one activation: what a message costs in the emulator."""
    setup = worker.setup
    t = torch.zeros(setup.activation_shape, dtype=setup.activation_dtype, device=setup.device)
    times = []
    for _ in range(rounds + 1):
        start = time.perf_counter()
        t.clone()
        if setup.device.type == "cuda":
            torch.cuda.synchronize(setup.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def emulator_profiling(schedule: object, workers: list["StageWorker"]) -> Callable[[list[Op]], None] | None:
    """Attach profilers to the emulator's workers; return its sync hook (None: nothing to profile)."""
    from megatron.pipeline.schedules.profiled import ProfiledSchedule

    if not isinstance(schedule, ProfiledSchedule):
        return None
    if schedule.decided:  # a later segment of the run: the order is known
        return None
    _note_short_run(schedule, log=True)
    for w in workers:
        w.profiler = w.profiler or OpProfiler(w.setup.device)  # keeps timings of earlier segments

    def hook(ops: list[Op]) -> None:
        if not _due(schedule, ops[0]):
            return
        summaries = []
        for w in workers:
            assert w.profiler is not None
            w.profiler.t_comm = measure_clone(w)
            summaries.append(w.profiler.summary())
            w.profiler = None
        n = schedule.config.num_stages
        decide(schedule, costs_from_summaries(summaries, list(range(n)), n), log=True)

    return hook


# ------------------------------------------------------------------ distributed


def measure_p2p(worker: "StageWorker", groups: "StageGroups", timeout: timedelta,
                rounds: int = PING_ROUNDS) -> float:
    """One-way time of an activation between this stage and the next (0 on the last stage).

    Neighbouring pairs take turns (pair (0, 1), then (1, 2), ...), each ``rounds`` timed round
    trips after one untimed; every stage of the pipeline must call this at the same point.
    """
    import torch.distributed as dist

    setup, layout = worker.setup, groups.layout
    n, stage, dp = layout.pipeline_size, groups.stage, groups.dp_rank
    buf = torch.zeros(setup.activation_shape, dtype=setup.activation_dtype, device=setup.device)

    def wait(work: "dist.Work") -> None:
        work.wait(timeout)
        if setup.device.type == "cuda":
            torch.cuda.synchronize(setup.device)

    hop = 0.0
    for left in range(n - 1):
        if stage == left:
            peer = layout.rank(left + 1, dp)
            times = []
            for _ in range(rounds + 1):
                start = time.perf_counter()
                wait(dist.isend(buf, dst=peer))
                wait(dist.irecv(buf, src=peer))
                times.append(time.perf_counter() - start)
            hop = statistics.median(times[1:]) / 2
        elif stage == left + 1:
            peer = layout.rank(left, dp)
            for _ in range(rounds + 1):
                wait(dist.irecv(buf, src=peer))
                wait(dist.isend(buf, dst=peer))
    return hop


def distributed_profiling(
    schedule: object, worker: "StageWorker", groups: "StageGroups", timeout: timedelta, log: bool
) -> Callable[[Op], None] | None:
    """Attach a profiler to this rank's worker; return the executor's sync hook (or None)."""
    from megatron.pipeline.schedules.profiled import ProfiledSchedule

    if not isinstance(schedule, ProfiledSchedule):
        return None
    if schedule.decided:  # a later segment of the run: the order is known
        return None
    _note_short_run(schedule, log)
    worker.profiler = worker.profiler or OpProfiler(worker.setup.device)  # keeps earlier segments' timings

    def all_gather(values: list[float], dtype: torch.dtype) -> list[list[float]]:
        import torch.distributed as dist

        mine = torch.tensor(values, dtype=dtype, device=worker.setup.device)
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(out, mine, async_op=True).wait(timeout)
        return [t.tolist() for t in out]

    def hook(op: Op) -> None:
        if not _due(schedule, op):
            return
        profiler = worker.profiler
        assert profiler is not None
        worker.profiler = None
        profiler.t_comm = measure_p2p(worker, groups, timeout)
        rows = all_gather(profiler.summary(), torch.float64)
        layout = groups.layout
        stage_of = [layout.coords(r)[0] for r in range(layout.world_size)]
        decide(schedule, costs_from_summaries(rows, stage_of, layout.pipeline_size), log=log)
        prints = {int(r[0]) for r in all_gather([schedule.fingerprint()], torch.int64)}
        if len(prints) != 1:
            raise RuntimeError(f"{schedule.name}: ranks derived different schedules from the same profile")

    return hook


def log_fixed_choice(schedule: object) -> None:
    """Log the simulated bubble of a zb-1p / zb-2p order from fixed costs (no profiling)."""
    from megatron.pipeline.schedules.profiled import describe_choice
    from megatron.pipeline.schedules.zb_1p import ZeroBubbleAuto

    if isinstance(schedule, ZeroBubbleAuto):
        try:
            log_choice(describe_choice(type(schedule), schedule.config, schedule.costs))
        except Exception as exc:  # noqa: BLE001 - a log line must never stop training
            print(f"[megatron-async] {schedule.name}: could not describe the schedule: {exc}", file=sys.stderr)
