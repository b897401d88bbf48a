"""Optimizer post-validation (Zero Bubble, Qi et al. §4 and Appendix C), as schedule data.

A synchronous schedule ends every iteration with ``OPT(sync=True)``, a pipeline-wide
collective: the global gradient norm (for clipping) and the non-finite check need every
stage's gradients. Post-validation (``ScheduleConfig.options["post_validation"] = True``)
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
weights, on that stage or upstream, and *every* stage replays them. After yielding
``VALIDATE #k`` a post-validated stream reads the recorded outcome
(:class:`ValidationOutcomes`; executors record it when they run the VALIDATE and must not
pull ops past a VALIDATE before running it) and, on a replay, yields

1. ``DISCARD`` for each of its pre-validation forwards (stash, weight version and loss of
   that micro-batch are dropped; the stage's dropout RNG is rewound to where it was at the
   PSTEP, so the replay draws the same masks a synchronous run draws);
2. ``DRAIN`` for each activation an upstream stage sent before its own VALIDATE that this
   stage had not consumed before its VALIDATE -- the upstream stage sends it again when it
   replays, so the stale copy is received and dropped. The list follows from the schedule
   (upstream pre-validation sends minus own pre-validation receives, in send order);
3. the pre-validation forwards again, receiving what the upstream stage re-sends.

All of it is ordinary ops with messages derived in :mod:`megatron.pipeline.comm`, so the
replay engine, the validator and both executors see exactly the same thing; the validator
drives the outcomes itself (:func:`megatron.pipeline.validate.validate_schedule` checks
the never / always / alternating replay patterns).

When no stage's weights change (no clipping, all finite; or non-finite gradients with no
stage having stepped, e.g. a NaN loss, which poisons every stage) nothing is replayed.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

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

if TYPE_CHECKING:
    from megatron.pipeline.runtime.worker import StageWorker

#: ``ScheduleConfig.options`` key that turns each synchronous step into PSTEP + VALIDATE
POST_VALIDATION = "post_validation"


# ------------------------------------------------------------------------------ outcomes


class ValidationOutcomes:
    """Whether each update's VALIDATE replays the pre-validation forwards.

    Written by the executor that runs ``VALIDATE #k`` (every stage writes the same value),
    read by the stream generators right after they yielded it. ``assume`` answers for
    updates nobody recorded (e.g. ``False`` to simulate timing without an executor);
    otherwise an unrecorded outcome is an error: some executor pulled the stream past a
    VALIDATE it had not run.
    """

    def __init__(self, assume: bool | None = None):
        self.assume = assume
        self._replay: dict[int, bool] = {}

    def record(self, update: int, replay: bool) -> None:
        known = self._replay.get(update)
        if known is not None and known != replay:
            raise RuntimeError(
                f"post-validation: stages disagree whether update {update} replays its "
                f"pre-validation forwards ({known} vs {replay})")
        self._replay[update] = replay

    def replay(self, update: int) -> bool:
        if update in self._replay:
            return self._replay[update]
        if self.assume is not None:
            return self.assume
        raise RuntimeError(
            f"post-validation: the outcome of VALIDATE #{update} is read before it ran; an "
            f"executor must run a VALIDATE before pulling the ops that follow it")

    def __repr__(self) -> str:
        return f"ValidationOutcomes({self._replay}, assume={self.assume})"


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
    """Activations sent to ``stage`` by other stages' pre-validation forwards that ``stage``'s
    own pre-validation forwards did not receive, in the order each sender sent them."""
    received: set[Message] = {m for op in prefixes[stage] for m in op_recvs(op, layout)}
    stale = []
    for sender in range(layout.num_stages):
        if sender == stage:
            continue
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
    other stages too (only on a replay) to know which activations they sent before validation.
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
            if outcomes.replay(it - 1):
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
    replay: bool  # some stage's weights change at validation: re-run pre-validation forwards


def global_outcome(sq_norms: Sequence[float], clip_grad: float, clip_coef: Callable[[float, float], float]) -> GlobalOutcome:
    g = decide(sq_norms, clip_grad, clip_coef)
    stepped = tuple(decide(sq_norms[: t + 1], clip_grad, clip_coef).clean for t in range(len(sq_norms)))
    # Weights change on stage t unless the optimistic step stands (clean) or, with non-finite
    # gradients, the stage held back (a skip leaves its weights as they were at the PSTEP).
    replay = not g.clean and (g.finite or any(stepped))
    return GlobalOutcome(g, stepped, replay)


# ------------------------------------------------------------------------------ worker side


@dataclass
class _Pending:
    update: int
    lr: float
    unscale: float  # the inverse loss scale the gradients are unscaled with (1.0 without fp16)
    stepped: bool
    sq_norms: list[float]  # the partial state this stage sent on (global on the last stage)
    rng: Any  # the stage's RNG state at the PSTEP (before the first pre-validation forward)


@dataclass
class PostValidationState:
    """A stage worker's post-validation bookkeeping (one pending update at a time)."""

    pending: _Pending | None = None
    optimistic_steps: int = 0
    rollbacks: int = 0
    redos: int = 0
    replays: int = 0
    log: list[dict[str, Any]] = field(default_factory=list)


def _state_tensor(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.float64, device=device)


def partial_step(worker: StageWorker, op: Op, received: torch.Tensor | None) -> torch.Tensor | None:
    """PSTEP: combine the partial state, step optimistically, keep the grads.

    Returns the partial state to send to the next stage (None on the last stage).
    """
    pv = worker.post_validation
    if pv.pending is not None:
        raise RuntimeError(f"stage {worker.stage}: {op} while update {pv.pending.update} is not validated yet")
    n = worker.layout.num_stages
    own = worker.grad_sq_norm(op)
    sq_norms = [0.0] * n if received is None else [float(x) for x in received.tolist()]
    if len(sq_norms) != n:
        raise RuntimeError(f"stage {worker.stage}: {op} received a state of {len(sq_norms)} stages, expected {n}")
    sq_norms[worker.stage] = own
    opt = worker.setup.optimizer
    stepped = decide(sq_norms[: worker.stage + 1], worker.setup.clip_grad, opt.clip_coef).clean
    lr = worker.setup.lr_schedule.lr(opt.step_count + 1)
    unscale = worker.inv_loss_scale
    if stepped:
        opt.step(lr, grad_scale=unscale)
        pv.optimistic_steps += 1
    pv.pending = _Pending(op.update, lr, unscale, stepped, sq_norms, worker.rng_state())
    if worker.stage == n - 1:
        return None
    return _state_tensor(sq_norms, worker.setup.device)


def validate(worker: StageWorker, op: Op, received: torch.Tensor | None) -> tuple[torch.Tensor | None, bool]:
    """VALIDATE: amend the optimistic step from the global state; zero the grads.

    Returns (the global state to send to the previous stage or None on stage 0, whether the
    pre-validation forwards replay).
    """
    pv = worker.post_validation
    pending = pv.pending
    if pending is None or pending.update != op.update:
        have = "nothing" if pending is None else f"update {pending.update}"
        raise RuntimeError(f"stage {worker.stage}: {op} but {have} is pending validation")
    sq_norms = pending.sq_norms if received is None else [float(x) for x in received.tolist()]
    opt = worker.setup.optimizer
    outcome = global_outcome(sq_norms, worker.setup.clip_grad, opt.clip_coef)
    if outcome.stepped[worker.stage] != pending.stepped:
        raise RuntimeError(
            f"stage {worker.stage}: {op}: the global state {sq_norms} does not extend the partial "
            f"state this stage decided on")
    g = outcome.decision
    rolled_back = redone = False
    if g.clean:
        worker.record_update(op.update, g.total_sq, pending.lr)
    else:
        if pending.stepped:
            opt.rollback(pending.lr, pending.unscale)
            rolled_back = True
            pv.rollbacks += 1
        if g.finite:
            opt.step(pending.lr, grad_scale=g.coef * pending.unscale)
            redone = True
            pv.redos += 1
            worker.record_update(op.update, g.total_sq, pending.lr)
        else:
            worker.record_update(op.update, g.total_sq, None)
    # fp16: every stage updates its scaler from the global state here, before its next
    # backward (the last stage's VALIDATE precedes its first backward of the next iteration).
    worker.update_loss_scale(not g.finite)
    opt.zero_grad()
    if outcome.replay:
        worker.set_rng_state(pending.rng)
        pv.replays += 1
    pv.log.append({"update": op.update, "stepped": pending.stepped, "rolled_back": rolled_back,
                   "redone": redone, "replay": outcome.replay, "coef": g.coef, "finite": g.finite})
    pv.pending = None
    send = None if worker.stage == 0 else _state_tensor(sq_norms, worker.setup.device)
    return send, outcome.replay


def run_post_validation_op(
    worker: StageWorker,
    op: Op,
    inputs: dict[Message, torch.Tensor],
    outcomes: ValidationOutcomes | None,
) -> dict[Message, torch.Tensor]:
    """Run PSTEP, VALIDATE, DISCARD or DRAIN on ``worker``; return the tensors to send.

    VALIDATE records its outcome in ``outcomes`` (which the stream generator reads next).
    """
    layout = worker.layout
    received = [inputs[m] for m in op_recvs(op, layout)]
    tensor = received[0] if received else None
    out: torch.Tensor | None = None
    if op.kind is OpKind.PSTEP:
        out = partial_step(worker, op, tensor)
    elif op.kind is OpKind.VALIDATE:
        if outcomes is None:
            raise RuntimeError(f"stage {worker.stage}: {op} needs the schedule's ValidationOutcomes")
        out, replay = validate(worker, op, tensor)
        outcomes.record(op.update, replay)
    elif op.kind is OpKind.DISCARD:
        worker.discard_forward(op)
    elif op.kind is OpKind.DRAIN:
        pass  # the stale activation was received; dropping it is the whole point
    else:
        raise ValueError(f"stage {worker.stage}: {op} is not a post-validation op")
    sends = op_sends(op, layout)
    if sends:
        assert out is not None
        return {sends[0]: out}
    return {}


def state_spec(layout: PipelineLayout) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of a PARTIAL_STATE / GLOBAL_STATE message."""
    return (layout.num_stages,), torch.float64


def is_state_message(msg: Message) -> bool:
    return msg.kind in (MsgKind.PARTIAL_STATE, MsgKind.GLOBAL_STATE)


__all__ = [
    "POST_VALIDATION",
    "GlobalOutcome",
    "PostValidationState",
    "StateDecision",
    "ValidationOutcomes",
    "decide",
    "global_outcome",
    "is_state_message",
    "partial_step",
    "post_validated_stream",
    "run_post_validation_op",
    "stale_activations",
    "state_spec",
    "validate",
]
