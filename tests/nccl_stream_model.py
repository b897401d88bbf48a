"""A paper model of how the distributed runtime's P2P would execute on NCCL (docs/gpu.md, F1).

gloo lets a posted receive wait without holding anything back. NCCL runs every operation of a
communicator on that communicator's single stream, in posting order, and a kernel finishes only
when its counterpart runs (``ProcessGroupNCCL::pointToPoint``: one stream per communicator key;
a receive at the head of a stream holds back every later send on it). This module runs the
runtime's *posting order* -- the same prefetch window, barriers and op-to-message mapping as
:class:`~megatron.pipeline.runtime.executors.distributed.DistributedExecutor` -- against that stream
model, under a choice of communicator per message:

* ``shared_pair``: one communicator per stage pair (torch's lazy 2-rank P2P communicators);
* ``one_world``: one communicator for all P2P (``init_process_group(device_id=...)``, eager);
* ``per_direction``: one communicator per ordered pair (the fix docs/gpu.md proposes).

Matching is rendezvous: a send and its receive complete together when both are at the head of
their streams (NCCL may buffer small sends, which only ever helps a *send* at a head; the
cycles this model reports have receives at the heads). Synchronous steps are collectives on a
separate communicator per sync group. Schedules with repeated message names (post-validation reruns) are
out of scope.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable

from megatron.pipeline.comm import Message, op_recvs, op_sends
from megatron.pipeline.runtime.executors.distributed import _is_barrier
from megatron.pipeline.ir import OpKind
from megatron.pipeline.schedules.base import Schedule

# ("send" | "recv" | "wait", Message) or ("coll" | "wait_coll", (sync group, update))
Event = tuple[str, object]
KeyFn = Callable[[Message], Hashable]

COMMUNICATORS: dict[str, KeyFn] = {
    "shared_pair": lambda m: frozenset((m.src_stage, m.dst_stage)),
    "one_world": lambda m: "world",
    "per_direction": lambda m: (m.src_stage, m.dst_stage),
}


def posting_program(schedule: Schedule, stage: int, prefetch_ops: int = 4) -> list[Event]:
    """What ``DistributedExecutor.run`` posts and waits for, in order, on ``stage``."""
    layout, events = schedule.layout, []
    ops, window = iter(schedule.stage_ops(stage)), deque()
    while True:
        while len(window) < prefetch_ops and not (window and _is_barrier(window[-1])):
            op = next(ops, None)
            if op is None:
                break
            window.append(op)
            events += [("recv", m) for m in op_recvs(op, layout) if m.src_stage != m.dst_stage]
        if not window:
            return events
        current = window.popleft()
        if current.kind is OpKind.OPT:
            group = layout.sync_group(stage)
            if current.sync and len(group) > 1:
                events += [("coll", (group, current.update)), ("wait_coll", (group, current.update))]
            continue
        events += [("wait", m) for m in op_recvs(current, layout) if m.src_stage != m.dst_stage]
        events += [("send", m) for m in op_sends(current, layout) if m.src_stage != m.dst_stage]


def stalls(schedule: Schedule, communicator: str, prefetch_ops: int = 4) -> dict[int, Event] | None:
    """Run every stage's program against the stream model; None if all finish, else each
    unfinished stage's blocking CPU event (a deadlock: nothing can progress)."""
    key_of = COMMUNICATORS[communicator]
    n = schedule.layout.num_stages
    programs = [deque(posting_program(schedule, s, prefetch_ops)) for s in range(n)]
    streams: dict[tuple[int, Hashable], deque[Event]] = {}
    done: set[object] = set()

    def stream(stage: int, key: Hashable) -> deque[Event]:
        return streams.setdefault((stage, key), deque())

    progress = True
    while progress:
        progress = False
        for s, program in enumerate(programs):  # CPUs post until they block on a wait
            while program:
                kind, what = program[0]
                if kind in ("wait", "wait_coll"):
                    if ("coll", what) not in done and ("msg", what) not in done:
                        break
                elif kind == "coll":
                    stream(s, ("collective", what[0])).append((kind, what))  # type: ignore[index]
                else:
                    stream(s, key_of(what)).append((kind, what))  # type: ignore[arg-type]
                program.popleft()
                progress = True
        for (s, key), queue in list(streams.items()):  # streams match their heads
            if not queue:
                continue
            kind, what = queue[0]
            if kind == "send":
                peer = streams.get((what.dst_stage, key))  # type: ignore[union-attr]
                if peer and peer[0] == ("recv", what):
                    queue.popleft(), peer.popleft()
                    done.add(("msg", what))
                    progress = True
            elif kind == "coll":
                heads = [streams.get((t, key)) for t in what[0]]  # type: ignore[index]
                if all(h and h[0] == (kind, what) for h in heads):
                    for h in heads:
                        h.popleft()  # type: ignore[union-attr]
                    done.add(("coll", what))
                    progress = True
    blocked = {s: p[0] for s, p in enumerate(programs) if p}
    return blocked or None
