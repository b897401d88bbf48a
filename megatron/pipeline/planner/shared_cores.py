"""Iteration time when a host runs more pipeline ranks than it has cores (processor sharing).

Why: the timing simulator gives every stage a device of its own, which is what a GPU node does.
A CPU host is different once its ranks outnumber its cores: a 4-stage run on a 2-core laptop
(or this project's 2-core CI host) has at most two stages computing at any moment, and the
operating system time-slices the runnable ones. There the simulator's makespan is a lower bound
that can be half the truth (1F1B at N = 4, m = 8: 11 op-times of critical path, but 32 op-times
of work on 2 cores), and the planner would rank schedules by the wrong quantity: a schedule that
fills bubbles gains nothing when the cores are already full.

The model (pure, no torch):

* **The op graph.** The schedule's streams are replayed by the same
  :class:`~megatron.pipeline.replay.ReplayEngine` as the simulator, priced by the simulator's
  own :class:`~megatron.pipeline.costs.pricing.OpPricing` (per stage or per model part, plus the
  sender's ``t_send`` per message to another stage), but what travels in a message is *which op sent it*
  and its delay (``t_comm``; 0 for a V's turn on its own stage). That gives each op's inputs.
* **Processor sharing.** A stage is *runnable* when its next op's inputs have arrived. With
  ``r`` runnable stages on ``c`` cores each progresses at rate ``min(1, c / r)``: the
  scheduler's fair share (the runtime's CPU ranks compute on one thread each, and a rank
  blocked in a receive sleeps). Time advances from event to event: an op ends, a message
  arrives. The time keeping is the layer's one event clock under its shared-core model
  (:class:`~megatron.pipeline.event_clock.EventClock` with ``cores``), the clock of the
  simulator and the greedy schedulers; this module is its policy: which op is next on each
  stage, when its inputs are there, when a collective's members have all reached it.
* **Synchronous OPT.** A collective over ``layout.sync_group``: each member's part
  (``t_opt + t_sync``) becomes runnable once every member has reached it, and no member goes
  on before all have finished, as in the simulator.

With ``c >= N`` no stage is ever slowed and the makespan is the simulator's; with ``c = 1`` it
is the sum of all op durations (both are tests). ``cores`` may be fractional: a host whose
cores are shared by ``D`` data-parallel replicas of ``T`` tensor-parallel ranks gives each
pipeline ``cores / (D * T)`` (:func:`cores_per_pipeline`).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron.pipeline.comm import Message
from megatron.pipeline.event_clock import EventClock
from megatron.pipeline.ir import Op, PipelineLayout
from megatron.pipeline.replay import ReplayEngine
from megatron.pipeline.costs.op_costs import CostsLike
from megatron.pipeline.costs.pricing import OpPricing


@dataclass
class _Node:
    """One op of one stage: its work and the ops whose messages it waits for."""

    stage: int
    work: float
    inputs: list[tuple[int, float]] = field(default_factory=list)  # (sending node, delay after its end)
    group: int | None = None  # the collective this op belongs to (a synchronous OPT)


class _Sent:
    """What a replayed op sends: every message carries the sender's node and its delay."""

    __slots__ = ("node", "delay")

    def __init__(self, node: int, delay: float):
        self.node = node
        self.delay = delay

    def __contains__(self, msg: object) -> bool:
        return True

    def __getitem__(self, msg: Message) -> tuple[int, float]:
        return self.node, 0.0 if msg.local else self.delay


def op_graph(streams: Sequence[Any], layout: PipelineLayout,
             costs: CostsLike = None) -> tuple[list[_Node], list[list[int]], list[list[int]]]:
    """(nodes, each stage's node ids in order, each collective's node ids) of ``streams``."""
    n = layout.num_stages
    pricing = OpPricing(layout, costs)  # the simulator's pricing, not a restatement of it
    nodes: list[_Node] = []
    order: list[list[int]] = [[] for _ in range(n)]
    groups: list[list[int]] = []

    def add(node: _Node) -> int:
        nodes.append(node)
        order[node.stage].append(len(nodes) - 1)
        return len(nodes) - 1

    def execute(op: Op, inputs: dict[Message, Any]) -> _Sent:
        part = pricing.part(op)
        work = pricing.duration(op, part) + pricing.send_time(op, part)
        node = add(_Node(op.stage, work, list(inputs.values())))
        return _Sent(node, pricing.comm(part))

    def execute_sync(ops: list[Op]) -> None:
        gid = len(groups)
        groups.append([add(_Node(op.stage, pricing.sync_step(op.stage), group=gid)) for op in ops])

    ReplayEngine([iter(s) for s in streams], layout, execute, execute_sync).run()
    return nodes, order, groups


def shared_core_makespan(streams: Sequence[Any], layout: PipelineLayout, costs: CostsLike, cores: float) -> float:
    """End of the last op when the stages share ``cores`` cores (module docstring).

    The policy of the event clock's shared model: a stage's next op goes on the clock once the
    stage is idle and the ops it receives from have ended (a collective once every member has
    reached it); the clock keeps the time and resolves the ends."""
    clock = EventClock(layout.num_stages, cores=cores)  # checks cores before the replay's work
    nodes, order, groups = op_graph(streams, layout, costs)
    n = len(order)
    pos = [0] * n  # index of each stage's next op in order[s]
    unfinished = sum(map(len, order))

    def current(s: int) -> int | None:
        return order[s][pos[s]] if pos[s] < len(order[s]) else None

    def try_start(nid: int) -> None:
        """Put node ``nid`` (the next op of its idle stage) on the clock if it can start."""
        node = nodes[nid]
        if node.group is None:
            ready = _inputs_ready(node, clock.ends)
            if ready is not None:
                clock.place(node.stage, node.work, ready, key=nid)
            return
        members = groups[node.group]
        if all(current(nodes[m].stage) == m for m in members):
            clock.align([nodes[m].stage for m in members], [nodes[m].work for m in members])

    while unfinished:
        for s in range(n):
            nid = current(s)
            if nid is not None and clock.idle(s):
                try_start(nid)
        for s in clock.advance():
            pos[s] += 1
            unfinished -= 1
    return clock.makespan()


def _inputs_ready(node: _Node, ends: dict[Hashable, float]) -> float | None:
    """When every input of ``node`` is here (None while a sender has not ended)."""
    latest = 0.0
    for sender, delay in node.inputs:
        end = ends.get(sender)
        if end is None:
            return None
        latest = max(latest, end + delay)
    return latest


def cores_per_pipeline(host_cores: float, data_parallel: int = 1, tensor_parallel: int = 1) -> float:
    """The cores one pipeline's stages share when ``host_cores`` serve every replica's ranks."""
    return host_cores / (data_parallel * tensor_parallel)


def is_shared(cores: float | None, layout: PipelineLayout) -> bool:
    """Whether the stages outnumber the cores (otherwise the simulator's model holds as is)."""
    return cores is not None and cores < layout.num_stages


__all__ = ["cores_per_pipeline", "is_shared", "op_graph", "shared_core_makespan"]
