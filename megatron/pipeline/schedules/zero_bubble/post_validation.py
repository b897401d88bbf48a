"""Optimizer post-validation (Zero Bubble, Qi et al. §4 and Appendix C), as schedule data.

A synchronous schedule ends every iteration with ``OPT(sync=True)``, a pipeline-wide
collective: the global gradient norm (for clipping) and the non-finite check need every
stage's gradients. Post-validation (``PostValidationOptions.post_validation = True``)
replaces that barrier by a chain in each direction:

``PSTEP #k`` (end of iteration k on stage s)
    receive the partial state from stage s - 1 (stage 0 starts from nothing), add this
    stage's squared gradient norm, send it on to s + 1; step *optimistically* (unclipped)
    unless the partial state already says non-finite or clip coefficient < 1; keep the
    gradients. The state is the vector of per-stage squared norms (float64, 0 for stages
    not reached yet), so every stage later sums exactly what a synchronous step sums
    (``math.fsum`` in stage order) and gets the same clip coefficient, bit for bit.

``VALIDATE #k`` (in iteration k + 1's stream, right before the stage's first backward;
only the warm-up forwards of k + 1 run before it, and they do not touch gradients)
    receive the global state from s + 1 (the last stage has it from its PSTEP), send it on
    to s - 1, then: no clipping needed and finite -> the optimistic step stands; clipping
    needed -> roll back if this stage stepped, redo with the clip coefficient;
    non-finite -> roll back if it stepped, skip (logged like a synchronous skip). Then the
    gradients are zeroed. The last iteration's VALIDATE ends the stream.

Why a stage that did not step is never wrong: the partial state only grows along the
chain (an OR of the non-finite flags, a sum of non-negative terms, and ``fsum`` of a
prefix is exactly rounded, hence monotone), so whatever made a stage hold back also
makes the global state demand clipping or a skip.

**Re-running the pre-validation forwards.** The global state is identical on every stage,
so every stage can tell from it alone what each stage did at its PSTEP (it recomputes each
prefix sum) and whether any stage's weights change at validation. If one does (a rollback,
a redo, or both), the forwards of iteration k + 1 that ran before VALIDATE used invalid
weights, on that stage or upstream, and *every* stage re-runs them. After yielding
``VALIDATE #k`` a post-validated stream reads the recorded outcome
(:class:`ValidationOutcomes`; executors record it when they run the VALIDATE and must not
pull ops past a VALIDATE before running it) and, on a rerun, yields

1. ``DISCARD`` for each of its pre-validation forwards (stash, weight version and loss of
   that micro-batch are dropped; the stage's dropout RNG is rewound to where it was at the
   PSTEP, so the rerun draws the same masks a synchronous run draws);
2. ``DRAIN`` for each activation an upstream stage sent before its own VALIDATE that this
   stage had not consumed before its VALIDATE -- the upstream stage sends it again when it
   re-runs, so the stale copy is received and dropped. The list follows from the schedule
   (upstream pre-validation sends minus own pre-validation receives, in send order);
3. the pre-validation forwards again, receiving what the upstream stage re-sends.

All of it is ordinary ops with messages derived in :mod:`megatron.pipeline.comm`, so the
replay engine, the schedule check and both executors see exactly the same thing; the schedule check
drives the outcomes itself (:func:`megatron.pipeline.schedule_check.check_schedule` checks
the never / always / alternating rerun patterns).

When no stage's weights change (no clipping, all finite; or non-finite gradients with no
stage having stepped, e.g. a NaN loss, which poisons every stage) nothing is re-run.

This module is the schedule half and loads no torch: the streams, the outcomes and the
decisions (:func:`decide`, :func:`global_outcome`), all plain floats, so the schedule check and
the simulator use them without a tensor library. What PSTEP and VALIDATE do to a stage's
weights and the state tensors on the wire are the runtime half,
:mod:`megatron.pipeline.runtime.post_validation_ops`.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from megatron.pipeline.comm import Message, MsgKind, op_recvs, op_sends
from megatron.pipeline.ir import (
    BACKWARD_KINDS,
    DISCARD,
    DRAIN,
    OPT,
    PSTEP,
    VALIDATE,
    Op,
    OpKind,
    PipelineLayout,
)

#: the option (``PostValidationOptions.post_validation``) that turns each synchronous step into
#: PSTEP + VALIDATE, and the flag group's name for it
POST_VALIDATION = "post_validation"


# ------------------------------------------------------------------------------ outcomes


class ValidationOutcomes:
    """Whether each update's VALIDATE re-runs the pre-validation forwards.

    Written by the executor that runs ``VALIDATE #k`` (every stage writes the same value),
    read by the stream generators right after they yielded it. ``assume`` answers for
    updates nobody recorded (e.g. ``False`` to simulate timing without an executor);
    otherwise an unrecorded outcome is an error: some executor pulled the stream past a
    VALIDATE it had not run.
    """

    def __init__(self, assume: bool | None = None):
        self.assume = assume
        self._rerun: dict[int, bool] = {}

    def record(self, update: int, rerun: bool) -> None:
        known = self._rerun.get(update)
        if known is not None and known != rerun:
            raise RuntimeError(
                f"post-validation: stages disagree whether update {update} re-runs its "
                f"pre-validation forwards ({known} vs {rerun})")
        self._rerun[update] = rerun

    def rerun(self, update: int) -> bool:
        if update in self._rerun:
            return self._rerun[update]
        if self.assume is not None:
            return self.assume
        raise RuntimeError(
            f"post-validation: the outcome of VALIDATE #{update} is read before it ran; an "
            f"executor must run a VALIDATE before pulling the ops that follow it")

    def assuming(self, rerun: bool) -> ValidationOutcomes:
        """A copy that keeps the recorded outcomes and answers ``rerun`` for the others: what a
        timing model without an executor replays (it runs no VALIDATE to decide one)."""
        copy = ValidationOutcomes(assume=rerun)
        copy._rerun = dict(self._rerun)
        return copy

    def __repr__(self) -> str:
        return f"ValidationOutcomes({self._rerun}, assume={self.assume})"


class PostValidation:
    """A post-validated schedule's runtime state: the outcomes its streams read after each VALIDATE.

    Owned by the schedule's policy (one per schedule instance; a segment gets its own), and
    replaceable: a check replays the streams once per outcome pattern with fresh outcomes, and
    consecutive segments checked as one stream share one object.
    """

    def __init__(self, outcomes: ValidationOutcomes | None = None):
        self.outcomes = ValidationOutcomes() if outcomes is None else outcomes

    def __repr__(self) -> str:
        return f"PostValidation({self.outcomes!r})"


# ------------------------------------------------------------------------------ streams


def _prefix_forwards(ops: Sequence[Op]) -> list[Op]:
    """The forwards an iteration runs before its first backward (the pre-validation ones)."""
    prefix = []
    for op in ops:
        if op.kind in BACKWARD_KINDS or op.kind is OpKind.W:
            return prefix
        if op.kind is not OpKind.F:
            raise ValueError(f"post-validation: unexpected {op} before the first backward")
        prefix.append(op)
    raise ValueError("post-validation: an iteration without a backward cannot be post-validated")


def stale_activations(
    stage: int,
    prefixes: Sequence[Sequence[Op]],
    layout: PipelineLayout,
) -> list[Message]:
    """Activations sent to ``stage`` by pre-validation forwards (of other stages, or its own on a
    V's local turn, which it re-sends on the rerun as well) that ``stage``'s own pre-validation
    forwards did not receive, in the order each sender sent them."""
    received: set[Message] = {m for op in prefixes[stage] for m in op_recvs(op, layout)}
    stale = []
    for sender in range(layout.num_stages):
        sent = [m for op in prefixes[sender] for m in op_sends(op, layout) if m.dst_stage == stage]
        sent_set = set(sent)
        for m in received:
            if m.src_stage == sender and m not in sent_set:
                raise ValueError(
                    f"post-validation: stage {stage} receives {m} before its VALIDATE, but stage "
                    f"{sender} sends it only after its own VALIDATE (which waits for stage {stage})")
        stale.extend(m for m in sent if m not in received)
    return stale


def post_validated_stream(
    iteration_ops: Callable[[int, range], Iterator[Op]],
    stage: int,
    layout: PipelineLayout,
    num_microbatches: int,
    iterations: range,
    outcomes: ValidationOutcomes,
    synchronous_iterations: int = 0,
) -> Iterator[Op]:
    """One stage's stream of a synchronous schedule with post-validation (module docstring).

    ``iteration_ops(stage, microbatches)`` is the schedule's iteration body; it is called for
    other stages too (only on a rerun) to know which activations they sent before validation.
    ``iterations`` are global indices (a segment of the run); those below
    ``synchronous_iterations`` end with the synchronous ``OPT`` instead. The stream ends
    with the VALIDATE of its last step, so nothing is left pending at its end.
    """
    m = num_microbatches
    first_validated = max(iterations.start, synchronous_iterations)
    for it in iterations:
        mbs = range(it * m, (it + 1) * m)
        ops = list(iteration_ops(stage, mbs))
        if it < synchronous_iterations:
            yield from ops
            yield OPT(stage, it, sync=True)
            continue
        if it == first_validated:
            yield from ops
        else:
            prefix = _prefix_forwards(ops)
            yield from prefix
            yield VALIDATE(stage, it - 1)
            if outcomes.rerun(it - 1):
                for op in prefix:
                    yield DISCARD(stage, op.microbatch, op.chunk)
                prefixes = [
                    prefix if s == stage else _prefix_forwards(list(iteration_ops(s, mbs)))
                    for s in range(layout.num_stages)
                ]
                for msg in stale_activations(stage, prefixes, layout):
                    yield DRAIN(stage, msg.microbatch, msg.dst_chunk)
                yield from prefix
            yield from ops[len(prefix):]
        yield PSTEP(stage, it)
    if iterations and iterations[-1] >= synchronous_iterations:
        yield VALIDATE(stage, iterations[-1])


# ------------------------------------------------------------------------------ decisions


@dataclass(frozen=True)
class StateDecision:
    """What a (partial or global) state of per-stage squared norms asks for."""

    finite: bool
    total_sq: float  # fsum of the squared norms, in stage order
    coef: float  # clip coefficient; 1.0 = no clipping (also when not finite)

    @property
    def clean(self) -> bool:
        """The update is an unclipped step: exactly what an optimistic step did."""
        return self.finite and self.coef == 1.0

    @property
    def norm(self) -> float:
        return math.sqrt(self.total_sq) if self.finite else self.total_sq


def decide(sq_norms: Sequence[float], clip_grad: float, clip_coef: Callable[[float, float], float]) -> StateDecision:
    """The decision a synchronous step takes on these squared norms (same arithmetic)."""
    total = math.fsum(sq_norms)
    if not math.isfinite(total):
        return StateDecision(False, total, 1.0)
    coef = clip_coef(math.sqrt(total), clip_grad) if clip_grad > 0 else 1.0
    return StateDecision(True, total, coef)


@dataclass(frozen=True)
class GlobalOutcome:
    """Everything every stage derives from the global state of one update."""

    decision: StateDecision
    stepped: tuple[bool, ...]  # stage t stepped optimistically at its PSTEP
    rerun: bool  # some stage's weights change at validation: re-run pre-validation forwards


def global_outcome(sq_norms: Sequence[float], clip_grad: float, clip_coef: Callable[[float, float], float]) -> GlobalOutcome:
    g = decide(sq_norms, clip_grad, clip_coef)
    stepped = tuple(decide(sq_norms[: t + 1], clip_grad, clip_coef).clean for t in range(len(sq_norms)))
    # Weights change on stage t unless the optimistic step stands (clean) or, with non-finite
    # gradients, the stage held back (a skip leaves its weights as they were at the PSTEP).
    rerun = not g.clean and (g.finite or any(stepped))
    return GlobalOutcome(g, stepped, rerun)


def is_state_message(msg: Message) -> bool:
    """A PARTIAL_STATE / GLOBAL_STATE message (the squared-norm vector, not an activation)."""
    return msg.kind in (MsgKind.PARTIAL_STATE, MsgKind.GLOBAL_STATE)


__all__ = [
    "POST_VALIDATION",
    "GlobalOutcome",
    "StateDecision",
    "ValidationOutcomes",
    "decide",
    "global_outcome",
    "is_state_message",
    "post_validated_stream",
    "stale_activations",
]
