"""One event clock for the pipeline layer's schedulers (issue #40 item 3).

Why: the Zero Bubble greedy, the V greedy, AMDP's admission scheduler, the timing simulator and
the processor-sharing model each kept time their own way, and the copies drifted (one restated
another's pricing without its overlap and memory handling). They all place ops with costs on
stages that run one op at a time, in whatever order the *policy* chooses, and only the policy
differs. This module is the part they share; the policies (which op next, what it costs) stay
with their schedulers:

* the simulator replays given streams (:mod:`megatron.pipeline.simulator`; synchronous
  collectives align stages with :meth:`EventClock.align`);
* Zero Bubble's greedy places passes phase by phase (``schedules/zero_bubble/greedy.py``);
* the V greedy lets the stage free earliest choose its next op (``schedules/v_shape/greedy.py``);
* AMDP admits the op that can start earliest anywhere (``schedules/asynchronous/amdp.py``);
* processor sharing replays a schedule's op graph on stages that share fewer cores than there
  are stages (:mod:`megatron.pipeline.planner.shared_cores`).

Two rate models, one set of clocks. With a core per stage (``cores=None``, the *dedicated*
model) an op runs at full speed, so its end is fixed when it is placed: a list schedule. With
``cores`` below the number of stages (the *shared* model) an op's end depends on ops that start
later on other stages (they slow it down), so placing an op only starts it, and
:meth:`EventClock.advance` resolves the ends: it moves one global time ``now`` from event to
event (an op ends, an input arrives), every runnable stage progressing at rate
``min(1, cores / runnable)`` in between. Both models record into the same fields, which the
policies read directly: ``free``, ``ends``, ``busy``, ``bubble``, ``memory``.

The dedicated model: each stage has a clock, ``free[s]``, the end of its last op. Placing an op
on stage ``s`` with inputs ready at ``ready`` starts it at ``max(free[s], ready)`` and ends it
``duration`` later. The policy computes ``ready`` from :meth:`EventClock.arrival`: the
producer's recorded end plus the *sender's* ``comm`` delay across stages, nothing on the same
stage. The clock also keeps, per stage, the activation memory (deltas the policy prices), its
peak, the busy time, and the *bubble*: idle time after the stage's first op, accumulated as
``end - (free + duration)`` when an op waits for an input and as ``until - free`` when the
policy idles a stage on purpose (:meth:`EventClock.wait`). Those two forms are what the
schedulers always computed; keeping them keeps every result bit for bit (the fixture test).

The shared model: a policy places an op on an idle stage (:meth:`EventClock.idle`) once the
ends of its inputs' senders are known, with ``ready`` computed from them. The op is runnable
from ``ready`` on (to within ``_EPS``: a step to an arrival lands within rounding of it) and
ends when its work is done; then ``free[s]`` and ``ends[key]`` get its end. ``busy`` counts
work, and ``bubble`` the stage's waits for inputs between ops: time spent slowed down by the
other stages is neither. A collective starts every member's part at once, each progressing
like an op; the members leave together when the last part ends. The arithmetic is that of the
loop the model replaced (``left -= step * rate``, ``now += step``, the ``_EPS`` tests), so its
makespans are bit for bit those stored in the fixture.

Pure Python, no torch (tests/test_import_layers.py). Hot: the planner runs the greedy searches
many times, so the state is plain lists and a dict, read directly by the policies, and the
dedicated model pays one test of ``cores`` per op for the shared one.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

__all__ = ["EventClock"]

# shared model: an input due within _EPS of now has arrived, and an op with at most _EPS of work
# left has ended (steps are differences of floats, so an event lands within rounding of itself)
_EPS = 1e-9

# shared model: what a stage is doing (no op in flight; an op placed, runnable once its input is
# there; its part of a collective done, waiting for the other members' parts)
_IDLE, _RUNNING, _HELD = 0, 1, 2


class _Collective:
    """Shared model: the member stages of a collective in flight and how many finished their part."""

    __slots__ = ("stages", "done")

    def __init__(self, stages: list[int]):
        self.stages = stages
        self.done = 0


class EventClock:
    """Per-stage clocks of one schedule, dedicated or shared cores (module docstring).

    Attributes the policies read directly (index: stage): ``free`` (end of the last op; shared
    model: of the last op whose end is resolved), ``memory`` and ``peak_memory`` (activation
    memory now and at its highest, after each op), ``busy`` (sum of the durations placed),
    ``bubble`` (idle time after the first op), and ``max_bubble`` (the largest ``bubble`` so
    far); ``ends`` maps a policy's op key to its end; ``now`` is the shared model's global time.
    """

    __slots__ = ("free", "memory", "peak_memory", "busy", "bubble", "max_bubble", "ends", "comm", "_started",
                 "cores", "now", "_phase", "_left", "_ready", "_key", "_collective")

    def __init__(self, num_stages: int, comm: Sequence[float] | None = None, cores: float | None = None):
        """``comm[s]``: the delay from the end of an op on stage ``s`` to its message's arrival
        on another stage (0 for all stages if omitted). ``cores``: how many cores the stages
        share (the shared model); None gives every stage its own (the dedicated model)."""
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
        if cores is not None and not cores > 0:
            raise ValueError(f"cores must be positive, got {cores}")
        self.cores = cores
        self.now = 0.0
        shared = num_stages if cores is not None else 0  # the dedicated model keeps no op in flight
        self._phase = [_IDLE] * shared
        self._left = [0.0] * shared  # work left of the op in flight
        self._ready = [0.0] * shared  # when its inputs are there
        self._key: list[Hashable | None] = [None] * shared
        self._collective: list[_Collective | None] = [None] * shared

    @property
    def num_stages(self) -> int:
        return len(self.free)

    # -- queries ---------------------------------------------------------------------
    def arrival(self, key: Hashable, src_stage: int, dst_stage: int) -> float:
        """When the output of the op recorded as ``key`` on ``src_stage`` is on ``dst_stage``
        (``inf`` while that op is not placed, or in the shared model not ended)."""
        end = self.ends.get(key, math.inf)
        return end if src_stage == dst_stage else end + self.comm[src_stage]

    def start_time(self, stage: int, ready: float) -> float:
        """When an op with inputs ready at ``ready`` would start on ``stage`` (dedicated model)."""
        free = self.free[stage]
        return ready if ready > free else free

    def idle(self, stage: int) -> bool:
        """Whether ``stage`` can take its next op now: always in the dedicated model; in the
        shared model once its op in flight (if any) has ended."""
        return self.cores is None or self._phase[stage] == _IDLE

    def makespan(self) -> float:
        """End of the last op of any stage."""
        return max(self.free, default=0.0)

    # -- placing ---------------------------------------------------------------------
    def place(self, stage: int, duration: float, ready: float = 0.0, memory_delta: float = 0.0,
              key: Hashable | None = None) -> float:
        """Run an op of ``duration`` on ``stage`` once its inputs are there (``ready``); returns
        its start. Its end goes to ``free[stage]`` and, when ``key`` is given, to ``ends[key]``
        for :meth:`arrival`: at once in the dedicated model; in the shared model, where the
        stage must be idle and the op starts at ``max(ready, now)``, when :meth:`advance`
        reaches it."""
        free = self.free[stage]
        if self.cores is None:
            start = ready if ready > free else free
            end = start + duration
            idle = end - (free + duration)  # the schedulers' form of start - free (module docstring)
            self.free[stage] = end
            if key is not None:
                self.ends[key] = end
        else:
            start = self._start(stage, duration, ready, key, None)
            idle = start - free
        if self._started[stage]:
            self._idle(stage, idle)
        else:
            self._started[stage] = True
        self.busy[stage] += duration
        memory = self.memory[stage] = self.memory[stage] + memory_delta
        if memory > self.peak_memory[stage]:
            self.peak_memory[stage] = memory
        return start

    def wait(self, stage: int, until: float) -> None:
        """Idle ``stage`` until ``until`` (a policy that waits for the next arrival; dedicated
        model: under sharing a stage idles by not being given an op)."""
        if self.cores is not None:
            raise ValueError("wait is the dedicated model's: a shared-core stage idles until given an op")
        if self._started[stage]:
            self._idle(stage, until - self.free[stage])
        self.free[stage] = until

    def align(self, stages: Sequence[int], durations: Sequence[float]) -> float:
        """A collective over ``stages``: all enter at the latest of their clocks, each is busy
        for its own part (``durations``), and all leave together; returns the start. Dedicated
        model: they leave after the longest part. Shared model: the stages must be idle, the
        parts start now and progress like ops, and the stages leave when :meth:`advance` ends
        the last part."""
        if self.cores is None:
            start = max(self.free[s] for s in stages)
            end = start + max(durations)
            for s in stages:
                self.free[s] = end
        else:
            start = self.now
            collective = _Collective(list(stages))
            for s, duration in zip(stages, durations):
                self._start(s, duration, start, None, collective)
        for s, duration in zip(stages, durations):
            self.busy[s] += duration
            self._started[s] = True
        return start

    # -- the shared model's time -------------------------------------------------------
    def advance(self) -> list[int]:
        """Shared model: move ``now`` to the next event -- the first op to end at the current
        rates, or the next input to arrive -- and end what is done there. Returns the stages
        whose op ended (a collective's members together), none when the event is an arrival.

        With ``r`` stages runnable (op placed, inputs there) each progresses at
        ``min(1, cores / r)`` until the event, where ``r`` changes."""
        if self.cores is None:
            raise ValueError("advance is the shared model's: a dedicated op's end is fixed when placed")
        now = self.now
        horizon = now + _EPS
        phase, left, ready_at = self._phase, self._left, self._ready
        runnable: list[int] = []
        step = math.inf
        for s, doing in enumerate(phase):
            if doing != _RUNNING:
                continue
            ready = ready_at[s]
            if ready <= horizon:
                runnable.append(s)
            else:
                until = ready - now
                if until < step:
                    step = until
        if not runnable and step == math.inf:
            raise RuntimeError("shared-core clock: nothing in flight to advance (the policy stalled)")
        rate = min(1.0, self.cores / len(runnable)) if runnable else 0.0
        for s in runnable:
            until = left[s] / rate
            if until < step:
                step = until
        now += step
        self.now = now
        ended: list[int] = []
        for s in runnable:
            left[s] -= step * rate
            if left[s] > _EPS:
                continue
            collective = self._collective[s]
            if collective is None:
                self._end(s, now)
                ended.append(s)
                continue
            phase[s] = _HELD
            collective.done += 1
            if collective.done == len(collective.stages):
                for member in collective.stages:
                    self._end(member, now)
                ended.extend(collective.stages)
        return ended

    def _start(self, stage: int, work: float, ready: float, key: Hashable | None,
               collective: _Collective | None) -> float:
        """Shared model: put an op in flight on idle ``stage``; returns its start."""
        if self._phase[stage] != _IDLE:
            raise ValueError(f"stage {stage} already has an op in flight")
        self._phase[stage] = _RUNNING
        self._left[stage] = work
        self._ready[stage] = ready
        self._key[stage] = key
        self._collective[stage] = collective
        now = self.now
        return ready if ready > now else now

    def _end(self, stage: int, now: float) -> None:
        """Shared model: the op in flight on ``stage`` ends at ``now``."""
        self.free[stage] = now
        self._phase[stage] = _IDLE
        self._collective[stage] = None
        key = self._key[stage]
        if key is not None:
            self.ends[key] = now

    def _idle(self, stage: int, idle: float) -> None:
        bubble = self.bubble[stage] = self.bubble[stage] + idle
        if bubble > self.max_bubble:
            self.max_bubble = bubble
