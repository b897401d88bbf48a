"""What the post-validation ops do on a stage worker: PSTEP, VALIDATE, DISCARD and DRAIN.

The schedule half, :mod:`megatron.pipeline.schedules.zero_bubble.post_validation`, yields these ops and decides
from plain floats (:func:`~megatron.pipeline.schedules.zero_bubble.post_validation.decide`,
:func:`~megatron.pipeline.schedules.zero_bubble.post_validation.global_outcome`); this half applies those
decisions to the stage's weights (optimistic step, rollback, redo, RNG rewind) and turns the
state into the tensors sent along the chain. Both executors call
:func:`run_post_validation_op`, so the runtime and the emulator amend steps identically.
"""
from __future__ import annotations

import torch

from megatron.pipeline.comm import Message, op_recvs, op_sends
from megatron.pipeline.ir import Op, OpKind
from megatron.pipeline.schedules.zero_bubble.post_validation import ValidationOutcomes, decide, global_outcome
from megatron.pipeline.runtime.post_validation_state import PendingUpdate, state_tensor, state_values
from megatron.pipeline.runtime.worker import StageWorker


def partial_step(worker: StageWorker, op: Op, received: torch.Tensor | None) -> torch.Tensor | None:
    """PSTEP: combine the partial state, step optimistically, keep the grads.

    Returns the partial state to send to the next stage (None on the last stage).
    """
    pv = worker.post_validation
    if pv.pending is not None:
        raise RuntimeError(f"stage {worker.stage}: {op} while update {pv.pending.update} is not validated yet")
    n = worker.layout.num_stages
    own = worker.grad_sq_norm(op)
    sq_norms = [0.0] * n if received is None else state_values(received)
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
    pv.pending = PendingUpdate(op.update, lr, unscale, stepped, sq_norms, worker.rng_state())
    if worker.stage == n - 1:
        return None
    return state_tensor(sq_norms, worker.setup.device)


def validate(worker: StageWorker, op: Op, received: torch.Tensor | None) -> tuple[torch.Tensor | None, bool]:
    """VALIDATE: amend the optimistic step from the global state; zero the grads.

    Returns (the global state to send to the previous stage or None on stage 0, whether the
    pre-validation forwards re-run).
    """
    pv = worker.post_validation
    pending = pv.pending
    if pending is None or pending.update != op.update:
        have = "nothing" if pending is None else f"update {pending.update}"
        raise RuntimeError(f"stage {worker.stage}: {op} but {have} is pending validation")
    sq_norms = pending.sq_norms if received is None else state_values(received)
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
    if outcome.rerun:
        worker.set_rng_state(pending.rng)
        pv.reruns += 1
    pv.log.append({"update": op.update, "stepped": pending.stepped, "rolled_back": rolled_back,
                   "redone": redone, "rerun": outcome.rerun, "coef": g.coef, "finite": g.finite})
    pv.pending = None
    send = None if worker.stage == 0 else state_tensor(sq_norms, worker.setup.device)
    return send, outcome.rerun


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
        out, rerun = validate(worker, op, tensor)
        outcomes.record(op.update, rerun)
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


__all__ = ["partial_step", "run_post_validation_op", "validate"]
