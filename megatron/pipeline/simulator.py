"""Timing simulator: replays op streams with timestamps instead of tensors.

The model is the event model behind the Zero Bubble paper's Table 5 (Qi et al., §5.2 and
App. G), generalised to our IR and runtime:

* **Replay.** Streams are replayed by :class:`~megatron.pipeline.replay.ReplayEngine`, so the
  simulator obeys exactly the runtime's rules (non-blocking sends, blocking receives, FIFO per
  stage pair, a ``sync`` OPT is a collective), and timed by the layer's one event clock
  (:class:`~megatron.pipeline.event_clock.EventClock`, the greedy schedulers' too) with the
  pricing of :class:`~megatron.pipeline.costs.pricing.OpPricing`. The payload of a message is its *arrival time*:
  the end of the sending op plus the sender's ``t_comm``. Communication takes no compute time
  on either side and any number of messages may be in flight.
* **Ops.** A stage runs its ops strictly in stream order, one at a time, without preemption.
  An op starts at ``max(stage free, arrival of each of its inputs)`` and lasts ``t_f``, ``t_b``
  (input gradient only), ``t_w`` (deferred weight gradient), ``t_bw`` (fused backward, default
  ``t_b + t_w``) or ``t_opt`` (optimizer step, default 0) of its stage (:class:`OpCosts`;
  one set for all stages or one per stage).
* **Runtime terms** (default 0; measured by ``benchmarks/calibrate_runtime.py``, see
  :mod:`megatron.pipeline.costs.calibration`). ``t_send``: what handing one message to the
  transport (an ``isend`` call) costs the *sender*: an op that sends ``k`` messages to other
  stages occupies its stage ``k * t_send`` longer (its span includes it). Its messages still
  arrive ``t_comm`` after the end of its compute: gloo hands the data over inside the call,
  so the receiver has it before the sender returns (measured: the end-to-end trip is shorter
  than the call). ``t_sync``: the
  latency of a synchronous step's collective (norm all-gather, statistics) at this pipeline
  depth, paid on top of ``t_opt`` by synchronous OPTs only.
* **Synchronous OPT.** All stages enter the collective together, at the latest of their free
  times, and all leave it at ``start + max_s (t_opt[s] + t_sync[s])``. A stage-local OPT
  (asynchronous schedules) starts when its stage is free and lasts ``t_opt``.
* **Per-stage span** (Zero Bubble App. G, objective (3)): from the start of the stage's first op
  to the end of its last op. The wait in front of the *final* synchronous OPT of the run is not
  counted (that OPT counts as starting right after the stage's previous op), so a one-iteration
  synchronous schedule is measured exactly like the paper's flush-free iteration; waits at
  earlier synchronous steps are real bubbles and do count. ``busy`` is the sum of the stage's op
  durations and ``bubble = span - busy``.
* **Bubble rate** (Zero Bubble §5.2, Table 5): ``(cost - ideal) / cost`` with
  ``cost = max_s span[s]`` ("the largest execution time of all stages", each stage's own span,
  not the global makespan) and ``ideal = max_s busy[s]``, which equals the paper's
  ``m (T_F + T_B + T_W)`` when all stages have the same costs.
* **Makespan**: end of the last op of any stage; all streams start at time 0.
* **Activation memory**, in units of ``M_B`` (the activations one micro-batch keeps on a stage
  for its backward) with ``M_W = m_w * M_B`` kept from a split B until its W (Zero Bubble
  App. G): F adds ``M_B``, B turns ``M_B`` into ``M_W`` (adds ``M_W - M_B``), W frees ``M_W``,
  a fused BW frees ``M_B``. The peak is taken after each op. ``m_w`` defaults to 1/2 (``op_costs.REFERENCE_M_W``), the
  reference scheduler's units (F = +2, B = -1, W = -1).
* **Activation recompute**: F keeps ``m_f * M_B`` (``m_f = 1`` without recompute; less with it,
  :mod:`megatron.pipeline.costs.activation_memory`), B turns it into ``M_W`` and a fused BW frees it;
  the recomputation's time is part of ``t_b`` / ``t_bw`` (``recompute_costs``). ``M_W`` stays as
  it was: B recomputes what W needs (the split linears' inputs) and W keeps it.
* **Several model chunks per stage** (interleaved schedules): costs and ``M_B`` are per op, i.e.
  per (micro-batch, chunk); pass per-chunk times. When the layout splits the model into as
  many parts as devices (one chain, or AMDP's replicated pipelines), per-stage costs are those
  of the *model part* an op runs (``layout.model_stage``): an AMDP device pays its hosted
  logical stage's cost, so a heavy first/last part (embedding, LM head) lands on every device
  that hosts a replica of it.
* **Weight-version drift** of a micro-batch on a stage: the number of optimizer steps the stage
  applied between the micro-batch's F and its B (or BW). Always 0 for synchronous schedules,
  and for schedules that stash weights (PipeDream-2BW: the backward reads its forward's version).
* **Weight memory**, in units of one stage's weights: the live weights plus what the schedule
  keeps beside them at peak (2BW's stashed version, PipeMare's T2 velocity buffer), from the
  schedule's ``weight_copies``.

Unbounded (asynchronous) streams are simulated up to a cap: ``max_microbatches = M`` keeps the
ops of micro-batches ``0 .. M-1`` (and the OPTs among them, plus the OPTs that directly follow
the stage's last such op) and ends each stage's stream once its last of those micro-batches
finished its backward and weight gradient. Every stage drops the same micro-batches, so the
messages still match. ``max_ops`` bounds how many ops are read from one stream (an error, not a
truncation, if exceeded), to catch a stream that never completes the capped micro-batches.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from megatron.pipeline.comm import Message
from megatron.pipeline.ir import Op, OpKind, PipelineLayout
from megatron.pipeline.costs.op_costs import CostsLike, OpCosts, costs_from_profile, load_profile, stage_costs
from megatron.pipeline.costs.pricing import OpPricing
from megatron.pipeline.event_clock import EventClock
from megatron.pipeline.overlap import check_overlap, overlap_saving
from megatron.pipeline.replay import ReplayEngine, ScheduleError

if TYPE_CHECKING:
    from megatron.pipeline.schedules.base import Schedule


# ------------------------------------------------------------------------------ result


class OpSpan(NamedTuple):
    start: float
    end: float
    op: Op


@dataclass
class SimulationResult:
    """What :func:`simulate_streams` returns; all lists are indexed by stage."""

    spans: list[list[OpSpan]]
    makespan: float
    busy: list[float]
    stage_span: list[float]
    peak_memory: list[float]  # units of M_B
    drift: list[dict[int, int]]  # stage -> {micro-batch: optimizer steps between F and B/BW}
    costs: tuple[OpCosts, ...] = field(repr=False, default=())
    weight_memory: list[float] = field(default_factory=list)  # units of the stage's weights

    @property
    def num_stages(self) -> int:
        return len(self.spans)

    @property
    def bubble(self) -> list[float]:
        return [span - busy for span, busy in zip(self.stage_span, self.busy)]

    @property
    def cost(self) -> float:
        """The paper's cost: the largest per-stage span."""
        return max(self.stage_span, default=0.0)

    @property
    def ideal(self) -> float:
        return max(self.busy, default=0.0)

    @property
    def bubble_rate(self) -> float:
        """Zero Bubble's bubble rate ``(cost - ideal) / cost``."""
        return (self.cost - self.ideal) / self.cost if self.cost > 0 else 0.0

    @property
    def stage_bubble_rate(self) -> list[float]:
        return [(s - b) / s if s > 0 else 0.0 for s, b in zip(self.stage_span, self.busy)]

    @property
    def max_drift(self) -> list[int]:
        return [max(d.values(), default=0) for d in self.drift]

    def to_dict(self, with_spans: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "num_stages": self.num_stages,
            "makespan": self.makespan,
            "cost": self.cost,
            "ideal": self.ideal,
            "bubble_rate": self.bubble_rate,
            "stages": [
                {
                    "stage": s,
                    "busy": self.busy[s],
                    "span": self.stage_span[s],
                    "bubble": self.bubble[s],
                    "bubble_rate": self.stage_bubble_rate[s],
                    "peak_memory": self.peak_memory[s],
                    "max_drift": self.max_drift[s],
                    "weight_memory": self.weight_memory[s] if self.weight_memory else 1.0,
                    "ops": len(self.spans[s]),
                }
                for s in range(self.num_stages)
            ],
            "costs": [asdict(c) for c in self.costs],
        }
        if with_spans:
            out["spans"] = [
                [
                    {"start": sp.start, "end": sp.end, "kind": sp.op.kind.value,
                     "microbatch": sp.op.microbatch, "chunk": sp.op.chunk, "update": sp.op.update}
                    for sp in spans
                ]
                for spans in self.spans
            ]
        return out


# ------------------------------------------------------------------------------ simulation


def cap_stream(
    stream: Iterable[Op], max_microbatches: int, num_chunks: int = 1, max_ops: int | None = None
) -> Iterator[Op]:
    """The ops of micro-batches ``< max_microbatches`` of one stage's (possibly unbounded) stream.

    Ends the stream once every one of those micro-batches has been forwarded and has finished
    its backward (BW, or B and W), after passing on the OPTs that directly follow.
    """
    need = max_microbatches * num_chunks
    forwarded = 0
    open_keys: set[tuple[int, int]] = set()
    done = need == 0
    read = 0
    for op in stream:
        read += 1
        if max_ops is not None and read > max_ops:
            raise ScheduleError(
                f"stage {op.stage}: read {max_ops} ops without completing micro-batches "
                f"0..{max_microbatches - 1}; raise max_ops or lower max_microbatches"
            )
        if op.kind is OpKind.OPT:
            yield op
            continue
        if done:
            return
        if op.microbatch >= max_microbatches:
            continue
        key = (op.microbatch, op.chunk)
        if op.kind is OpKind.F:
            forwarded += 1
            open_keys.add(key)
        elif op.kind is OpKind.BW or op.kind is OpKind.W:
            open_keys.discard(key)
        yield op
        if forwarded == need and not open_keys:
            done = True


def _limit_ops(stream: Iterable[Op], max_ops: int) -> Iterator[Op]:
    for i, op in enumerate(stream):
        if i >= max_ops:
            raise ScheduleError(f"stage {op.stage}: stream longer than max_ops = {max_ops}")
        yield op


class _SameForEvery:
    """Outputs of a simulated op: every message it sends to another stage arrives ``t_comm``
    after the op ends; one to its own stage (a V's turn) at the end, no transfer."""

    __slots__ = ("end", "arrival")

    def __init__(self, end: float, arrival: float):
        self.end = end
        self.arrival = arrival

    def __contains__(self, msg: object) -> bool:
        return True

    def __getitem__(self, msg: Message) -> float:
        return self.end if msg.local else self.arrival


def simulate_streams(
    streams: Sequence[Iterable[Op]],
    layout: PipelineLayout,
    costs: CostsLike = None,
    *,
    max_microbatches: int | None = None,
    max_ops: int | None = None,
    stashes_weights: bool = False,
    weight_copies: Sequence[float] | None = None,
    overlap: float = 0.0,
    overlapped: Callable[[Op], bool] | None = None,
) -> SimulationResult:
    """Replay ``streams`` with timestamps (model: module docstring).

    ``overlapped`` names the backwards of overlapped F&B slots (DualPipeV's), each shortened by
    ``overlap`` (0: serial F then B, 1: full overlap) as :mod:`megatron.pipeline.overlap` says.
    Raises :class:`~megatron.pipeline.replay.ScheduleError` for streams that cannot run.
    """
    overlap = check_overlap(overlap)
    n = layout.num_stages
    pricing = OpPricing(layout, costs)
    per_stage = pricing.per_stage
    if max_microbatches is not None:
        streams = [cap_stream(s, max_microbatches, layout.num_chunks, max_ops) for s in streams]
    elif max_ops is not None:
        streams = [_limit_ops(s, max_ops) for s in streams]

    clock = EventClock(n)  # arrivals travel in the replayed messages, so no comm table here
    spans: list[list[OpSpan]] = [[] for _ in range(n)]
    versions = [0] * n
    version_at_f: list[dict[tuple[int, int], int]] = [{} for _ in range(n)]
    drift: list[dict[int, int]] = [{} for _ in range(n)]

    def execute(op: Op, inputs: dict[Message, Any]) -> _SameForEvery:
        s = op.stage
        part = pricing.part(op)  # costs follow the model part (AMDP: logical stage)
        kind = op.kind
        duration = pricing.duration(op, part)
        if overlap and overlapped is not None and spans[s] and overlapped(op):
            forward = spans[s][-1]
            duration -= overlap_saving(overlap, forward.start, forward.end,
                                       max(inputs.values(), default=forward.start), duration)
        is_step = kind is OpKind.OPT
        start = clock.place(s, duration + pricing.send_time(op, part), max(inputs.values(), default=0.0),
                            0.0 if is_step else pricing.memory_delta(op, part))
        end = start + duration
        spans[s].append(OpSpan(start, clock.free[s], op))
        if is_step:
            versions[s] += 1
        elif kind is OpKind.F:
            version_at_f[s][(op.microbatch, op.chunk)] = versions[s]
        elif kind is OpKind.B or kind is OpKind.BW:
            d = versions[s] - version_at_f[s].pop((op.microbatch, op.chunk), versions[s])
            if stashes_weights:
                d = 0  # the backward reads the stashed version its forward read
            if d > drift[s].get(op.microbatch, -1):
                drift[s][op.microbatch] = d
        return _SameForEvery(end, end + pricing.comm(part))

    def execute_sync(ops: list[Op]) -> None:
        start = clock.align([op.stage for op in ops], [pricing.sync_step(op.stage) for op in ops])
        end = clock.free[ops[0].stage]  # all members leave together
        for op in ops:
            spans[op.stage].append(OpSpan(start, end, op))
            versions[op.stage] += 1

    ReplayEngine(list(streams), layout, execute, execute_sync).run()

    stage_span = []
    for s in range(n):
        ops = spans[s]
        if not ops:
            stage_span.append(0.0)
            continue
        last_end = ops[-1].end
        if ops[-1].op.kind is OpKind.OPT and ops[-1].op.sync:
            before = ops[-2].end if len(ops) > 1 else ops[-1].start
            last_end = before + per_stage[s].sync_step
        stage_span.append(last_end - ops[0].start)
    makespan = max((ops[-1].end for ops in spans if ops), default=0.0)
    weights = [1.0] * n if weight_copies is None else [float(c) for c in weight_copies]
    return SimulationResult(spans, makespan, clock.busy, stage_span, clock.peak_memory, drift, per_stage, weights)


def simulate_schedule(
    schedule: "Schedule",
    costs: CostsLike = None,
    *,
    max_microbatches: int | None = None,
    max_ops: int | None = None,
    overlap: float = 0.0,
) -> SimulationResult:
    """Simulate a :class:`~megatron.pipeline.schedules.base.Schedule`.

    ``costs`` defaults to the schedule's ``config.options.costs``, else :class:`OpCosts()`.
    An unbounded schedule (``num_iterations=None``) needs ``max_microbatches``. ``overlap``:
    how much of an overlapped F&B slot runs concurrently (schedules whose policy has an
    ``overlapped_backward`` predicate, DualPipeV; :mod:`megatron.pipeline.overlap`).
    """
    config = schedule.config
    if costs is None:
        costs = config.options.costs
    if config.num_iterations is None and max_microbatches is None:
        raise ValueError(f"{schedule.name}: unbounded stream; pass max_microbatches to simulate it")
    if schedule.policy.post_validation is not None:
        # No executor runs the VALIDATEs here: time a copy (outcomes are per stream) in which the
        # unrecorded ones keep their update, the common case (comm_volume walks the same way).
        outcomes = schedule.policy.post_validation.outcomes
        schedule = schedule.segment(config.first_iteration, config.num_iterations)  # type: ignore[arg-type]
        validation = schedule.policy.post_validation
        assert validation is not None
        validation.outcomes = outcomes.assuming(False)
    policy = schedule.policy
    return simulate_streams(
        schedule.streams(), schedule.layout, costs,
        max_microbatches=max_microbatches, max_ops=max_ops, stashes_weights=policy.stashes_weights,
        weight_copies=list(policy.weight_copies), overlap=overlap, overlapped=policy.overlapped_backward,
    )


def steady_time_per_update(build: Any, iterations: int, costs: CostsLike = None) -> float:
    """Marginal simulated time of one update, ``(makespan(k) - makespan(k/2)) / (k - k/2)`` for
    ``k = iterations``: the steady state without start-up and the final drain, which is what a
    long run's throughput sees (and what the benchmarks compare a measured run with).
    ``build(i)`` returns the schedule for ``i`` iterations."""
    half = iterations // 2
    if half < 1:
        raise ValueError(f"steady_time_per_update needs iterations >= 2, got {iterations}")
    spans = [simulate_schedule(build(i), costs).makespan for i in (half, iterations)]
    return (spans[1] - spans[0]) / (iterations - half)


__all__ = [
    "OpCosts",
    "OpSpan",
    "SimulationResult",
    "cap_stream",
    "costs_from_profile",
    "load_profile",
    "simulate_schedule",
    "simulate_streams",
    "stage_costs",
    "steady_time_per_update",
]
