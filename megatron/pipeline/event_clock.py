"""One event clock for the pipeline layer's list schedulers (issue #40 item 3).

Why: the Zero Bubble greedy, the V greedy, AMDP's admission scheduler and the timing
simulator each kept time their own way, and the copies drifted (one restated another's
pricing without its overlap and memory handling). They are all list schedulers over op
costs: ops are placed one at a time on stages that run one op at a time, in whatever order
the *policy* chooses, and only the policy differs. This module is the part they share; the
policies (which op next, what it costs) stay with their schedulers:

* the simulator replays given streams (:mod:`megatron.pipeline.simulator`; synchronous
  collectives align stages with :meth:`EventClock.align`);
* Zero Bubble's greedy places passes phase by phase (``schedules/zero_bubble/greedy.py``);
* the V greedy lets the stage free earliest choose its next op (``schedules/v_shape/greedy.py``);
* AMDP admits the op that can start earliest anywhere (``schedules/asynchronous/amdp.py``).

Not here: processor sharing (:mod:`megatron.pipeline.planner.shared_cores`, stages on fewer
cores). A list schedule fixes an op's end when it places the op; under sharing an op's end
depends on ops that start later on other stages (they slow it down), so that model advances
one global time from event to event. It shares the simulator's pricing
(:class:`~megatron.pipeline.costs.pricing.OpPricing`) and replay, not this clock.

The model: each stage has a clock, ``free[s]``, the end of its last op. Placing an op on
stage ``s`` with inputs ready at ``ready`` starts it at ``max(free[s], ready)`` and ends it
``duration`` later. The policy computes ``ready`` from :meth:`EventClock.arrival`: the
producer's recorded end plus the *sender's* ``comm`` delay across stages, nothing on the same
stage. The clock also keeps, per stage, the activation memory (deltas the policy prices), its
peak, the busy time, and the *bubble*: idle time after the stage's first op, accumulated as
``end - (free + duration)`` when an op waits for an input and as ``until - free`` when the
policy idles a stage on purpose (:meth:`EventClock.wait`). Those two forms are what the
schedulers always computed; keeping them keeps every result bit for bit (the fixture test).

Pure Python, no torch (tests/test_import_layers.py). Hot: the planner runs the greedy searches
many times, so the state is plain lists and a dict, read directly by the policies.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

__all__ = ["EventClock"]


class EventClock:
    """Per-stage clocks of one list schedule (module docstring).

    Attributes the policies read directly (index: stage): ``free`` (end of the last op),
    ``memory`` and ``peak_memory`` (activation memory now and at its highest, after each op),
    ``busy`` (sum of the durations placed), ``bubble`` (idle time after the first op), and
    ``max_bubble`` (the largest ``bubble`` so far); ``ends`` maps a policy's op key to its end.
    """

    __slots__ = ("free", "memory", "peak_memory", "busy", "bubble", "max_bubble", "ends", "comm", "_started")

    def __init__(self, num_stages: int, comm: Sequence[float] | None = None):
        """``comm[s]``: the delay from the end of an op on stage ``s`` to its message's arrival
        on another stage (0 for all stages if omitted)."""
        self.free = [0.0] * num_stages
        self.memory = [0.0] * num_stages
        self.peak_memory = [0.0] * num_stages
        self.busy = [0.0] * num_stages
        self.bubble = [0.0] * num_stages
        self.max_bubble = 0.0
        self.ends: dict[Hashable, float] = {}
        self.comm = [0.0] * num_stages if comm is None else list(comm)
        if len(self.comm) != num_stages:
            raise ValueError(f"{len(self.comm)} comm delays for {num_stages} stages")
        self._started = [False] * num_stages

    @property
    def num_stages(self) -> int:
        return len(self.free)

    # -- queries ---------------------------------------------------------------------
    def arrival(self, key: Hashable, src_stage: int, dst_stage: int) -> float:
        """When the output of the op recorded as ``key`` on ``src_stage`` is on ``dst_stage``
        (``inf`` while that op is not placed)."""
        end = self.ends.get(key, math.inf)
        return end if src_stage == dst_stage else end + self.comm[src_stage]

    def start_time(self, stage: int, ready: float) -> float:
        """When an op with inputs ready at ``ready`` would start on ``stage``."""
        free = self.free[stage]
        return ready if ready > free else free

    def makespan(self) -> float:
        """End of the last op of any stage."""
        return max(self.free, default=0.0)

    # -- placing ---------------------------------------------------------------------
    def place(self, stage: int, duration: float, ready: float = 0.0, memory_delta: float = 0.0,
              key: Hashable | None = None) -> float:
        """Run an op of ``duration`` on ``stage`` once its inputs are there (``ready``); returns
        its start. Records its end under ``key`` (when given) for :meth:`arrival`."""
        free = self.free[stage]
        start = ready if ready > free else free
        end = start + duration
        if self._started[stage]:
            self._idle(stage, end - (free + duration))
        else:
            self._started[stage] = True
        self.free[stage] = end
        self.busy[stage] += duration
        memory = self.memory[stage] = self.memory[stage] + memory_delta
        if memory > self.peak_memory[stage]:
            self.peak_memory[stage] = memory
        if key is not None:
            self.ends[key] = end
        return start

    def wait(self, stage: int, until: float) -> None:
        """Idle ``stage`` until ``until`` (a policy that waits for the next arrival)."""
        if self._started[stage]:
            self._idle(stage, until - self.free[stage])
        self.free[stage] = until

    def align(self, stages: Sequence[int], durations: Sequence[float]) -> tuple[float, float]:
        """A collective over ``stages``: all enter at the latest of their clocks and leave
        together after the longest of their ``durations`` (each stage is busy for its own).
        Returns (start, end)."""
        start = max(self.free[s] for s in stages)
        end = start + max(durations)
        for s, duration in zip(stages, durations):
            self.free[s] = end
            self.busy[s] += duration
            self._started[s] = True
        return start, end

    def _idle(self, stage: int, idle: float) -> None:
        bubble = self.bubble[stage] = self.bubble[stage] + idle
        if bubble > self.max_bubble:
            self.max_bubble = bubble
