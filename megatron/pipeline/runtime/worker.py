"""One pipeline stage's computation, independent of how messages travel.

The distributed runtime and the emulator both drive a :class:`StageWorker` op by op, so the
numbers they produce can only differ if the op order or the inputs differ.

Weight-version semantics: a stage's version is the number of optimizer updates it has
applied. Updates write through ``p.data`` (see the optimizer), so a micro-batch whose
forward ran on version v and whose backward runs after an update uses the *current*
weights in backward (PipeDream without stashing); the drift ``v_backward - v_forward`` is
recorded for every backward. Schedules that read other weights (2BW's stash, PipeMare's
corrected backward weights) plug in a :class:`~megatron.pipeline.runtime.weight_versions.WeightPolicy`;
the drift is then measured on the versions the policy actually put in place.

B/W split (Zero Bubble): op ``B`` is a backward with weight-gradient deferral on (see
:mod:`megatron.pipeline.runtime.wgrad`): it sends the same input gradient as ``BW``, layers that
support deferral queue ``(x, dy)`` instead of computing their weight gradients, and the
queue is kept per (micro-batch, chunk) until op ``W`` runs it. Modules without such layers
compute everything in B and their W is a no-op. Drift is recorded at B (or BW): that is when
the micro-batch's backward reads the weights.

Activation accounting (:class:`ActivationMeter`): a BW releases its micro-batch. A B shrinks
it to what W still holds (the queued ``x`` and ``dy`` tensors; ``dy`` was not saved by the
forward, so it is counted from B on) and W releases it; a micro-batch with nothing queued
is released at B already. So ``peak_count`` counts micro-batches holding any activation
memory, including those waiting only for W, and ``peak_bytes`` sees M_W, not M_B, for them.
Bytes are counted only with ``StageSetup.measure_activations`` (``--log-activation-memory``) or
around a profiled op; otherwise no saved-tensor hook runs and the byte figures stay 0.
"""
from __future__ import annotations

import contextlib
import math
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
# torch.autograd.backward(out, grad) imports this lazily on its first call (1-3 s on a loaded
# host): done here, the cost lands at start-up instead of inside the first traced/timed backward.
import torch.fx.experimental.symbolic_shapes  # noqa: F401

from megatron.pipeline.comm import Message, MsgKind
from megatron.pipeline.runtime.freed_outputs import backward_released, release_output
from megatron.pipeline.ir import Op
from megatron.pipeline.runtime.memory import ActivationMeter
from megatron.pipeline.runtime.op_hooks import OpHooks
from megatron.pipeline.schedules.zero_bubble.post_validation import is_state_message
from megatron.pipeline.runtime.post_validation_state import PostValidationState, state_spec
from megatron.pipeline.runtime.report import StageReport
from megatron.pipeline.runtime.stage_rng import StageRNG
from megatron.pipeline.runtime.stage_setup import Batch, StageSetup
from megatron.pipeline.runtime.tensor_parallel import tp_sq_sum
from megatron.pipeline.runtime.tied_embeddings import counted, tied_parameters
from megatron.pipeline.runtime.weight_versions import WeightPolicy
from megatron.pipeline.runtime.wgrad import DeferredWeightGrads, defer_weight_grads

if TYPE_CHECKING:
    from megatron.pipeline.runtime.gradient_sync import GradientSync
    from megatron.pipeline.runtime.op_profiler import OpProfiler
    from megatron.pipeline.runtime.tracing import StageTracer


class StageWorker:
    """Executes F / B / W / BW / OPT for one stage and keeps its statistics."""

    #: Keep every update's entry in ``update_log`` (and post-validation's ``log``) for the
    #: whole run. Off by default: the logs then hold the current logging interval only, so
    #: memory does not grow with the number of iterations. Tests that inspect a run's
    #: history turn it on (the ``keep_update_history`` fixture).
    keep_update_history: bool = False

    def __init__(self, setup: StageSetup, isolate_rng: bool = False, *, tracer: StageTracer | None = None,
                 profiler: OpProfiler | None = None, grad_sync: GradientSync | None = None):
        self.setup = setup
        self.stage = setup.stage
        self.layout = setup.layout
        # (micro-batch, chunk) -> (input, output, whether the output's storage was released)
        self._stash: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor, bool]] = {}
        self._fwd_version: dict[tuple[int, int], int] = {}
        self._aux_losses: dict[tuple[int, int], torch.Tensor] = {}  # setup.aux_loss_fn, until reported
        self._deferred: dict[tuple[int, int], DeferredWeightGrads] = {}  # B done, W pending
        self.meter = ActivationMeter(setup.optimizer.parameters(), measure_bytes=setup.measure_activations)
        self.weights = setup.weight_policy or WeightPolicy(setup.optimizer.parameters(), setup.optimizer)
        self.drift_histogram: Counter[int] = Counter()
        self.update_log: list[dict[str, Any]] = []  # per update of the interval: lr, norm, skipped
        self.post_validation = PostValidationState()  # see megatron.pipeline.schedules.zero_bubble.post_validation
        # (micro-batch, chunk) -> (loss, tokens) on the last stage, until reported: a report
        # for update k takes the micro-batches of updates <= k only (with post-validation the
        # next iteration's warm-up forwards run before update k is final and reported).
        self._losses: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}
        # The instruments around the ops, given here and switched on and off by their owners
        # (the runner traces training segments, profiling runs until the order is decided):
        self.hooks = OpHooks(tracer, profiler)
        # The data-parallel gradient reduction (runtime.gradient_sync): gradient ops run inside
        # it, the op core reduces through it before a step; None: one replica, nothing to reduce.
        self.grad_sync = grad_sync
        self._grad_ops_synced = grad_sync is not None and grad_sync.overlaps  # one check per backward
        self._rng = StageRNG(setup.seed + 100 * setup.stage, setup.device, isolate_rng)
        self._reset_interval()

    # -- helpers ---------------------------------------------------------------------
    @property
    def tracer(self) -> StageTracer | None:
        """The tracer recording this stage's ops now (``--trace-dir``, training segments only)."""
        return self.hooks.tracer

    @property
    def profiler(self) -> OpProfiler | None:
        """The profiler timing this stage's F / B / W now (while a profiled schedule profiles)."""
        return self.hooks.profiler

    @property
    def version(self) -> int:
        return self.setup.optimizer.step_count

    @torch.no_grad()
    def _param_sq(self) -> float:
        """Sum of squares of this stage's parameters (the live weights), in float64.

        Each tensor's norm is reduced in float64 without a float64 copy of the tensor (4x less
        time than squaring a copy: 5 instead of 21 ms per report for 6 M parameters, within
        1e-13 of it), then squared and summed: one host sync per report."""
        self.params_ready()
        params = counted(self.setup.optimizer.parameters())  # a tied embedding once
        if self.setup.tp_group is not None:
            return tp_sq_sum(((p, p) for p in params), self.setup.tp_group)
        norms = [torch.linalg.vector_norm(p.detach(), dtype=torch.float64) for p in params]
        return float(torch.stack(norms).square().sum()) if norms else 0.0

    def _reset_interval(self) -> None:
        if not self.keep_update_history:
            self.update_log.clear()
            self.post_validation.log.clear()
        self._drifts: list[int] = []
        self._updates = 0
        self._skipped = 0
        self._last_lr = 0.0
        self._last_norm = 0.0
        self.meter.reset_peaks()
        if self.setup.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.setup.device)

    def _batch(self, op: Op, batch_fn: Callable[[int], Batch] | None = None) -> Batch:
        """The micro-batch entries chunk ``op.chunk`` reads.

        The first and last virtual stages get the whole micro-batch. A middle one gets only the
        keys its module lists in ``middle_batch_keys`` (attention masks, which every layer
        applies: BERT's padding mask, GPT's ``--reset-attention-mask``), and no data is read
        for it at all when it lists none -- GPT's default.
        """
        batch_fn = batch_fn or self.setup.batch_fn
        if self.layout.is_first(self.stage, op.chunk) or self.layout.is_last(self.stage, op.chunk):
            return batch_fn(op.microbatch)
        keys = getattr(self.setup.chunks[op.chunk], "middle_batch_keys", ())
        if not keys:
            return {}
        batch = batch_fn(op.microbatch)
        return {k: batch[k] for k in keys if k in batch}

    def recv_spec(self, msg: Message) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of a tensor this stage receives."""
        if is_state_message(msg):
            return state_spec(self.layout)
        if msg.kind in (MsgKind.TIED_GRAD, MsgKind.TIED_SUM):  # the tied embedding's gradient
            (end,) = tied_parameters(self.setup.chunks)
            return tuple(end.shape), end.dtype
        if msg.kind is MsgKind.GRAD and self._stage_local_scaling:
            return self.setup.activation_shape, torch.float32  # unscaled gradients (loss_scaling)
        return self.setup.activation_shape, self.setup.activation_dtype

    # -- loss scaling (fp16; megatron.pipeline.runtime.loss_scaling) ----------------------------
    @property
    def _stage_local_scaling(self) -> bool:
        return self.setup.loss_scaler is not None and self.setup.loss_scaler.stage_local

    @property
    def inv_loss_scale(self) -> float:
        """What the optimizer multiplies the gradients by to unscale them (1.0 without scaling)."""
        return 1.0 if self.setup.loss_scaler is None else self.setup.loss_scaler.inv_scale

    def unscale_sq(self, sq_norm: float) -> float:
        """A squared norm of this stage's (scaled) gradients, unscaled (exact for 2^k scales)."""
        scaler = self.setup.loss_scaler
        return sq_norm if scaler is None else sq_norm / (scaler.scale * scaler.scale)

    def update_loss_scale(self, found_inf: bool) -> None:
        """Feed the step decision's non-finite flag to the scaler (after the decision is logged)."""
        if self.setup.loss_scaler is not None:
            self.setup.loss_scaler.update(found_inf)

    def params_ready(self) -> None:
        """Wait for the weights to be whole before reading them: ``--overlap-param-gather``
        leaves the distributed optimizer's parameter all-gather in flight after a step
        (:mod:`megatron.pipeline.runtime.distributed_optimizer`); a no-op otherwise."""
        self.setup.optimizer.wait_params()

    def rng_state(self) -> Any:
        """This stage's dropout RNG state (post-validation rewinds it for a rerun; checkpoints
        save it). The same form in the emulator and the runtime, so either can resume the other."""
        return self._rng.state()

    def set_rng_state(self, state: Any) -> None:
        self._rng.set_state(state)

    def in_flight(self) -> int:
        """Micro-batches whose forward ran but whose backward (or W) has not."""
        return len(self._stash) + len(self._deferred)

    # -- ops ---------------------------------------------------------------------------
    def forward(self, op: Op, received: torch.Tensor | None) -> torch.Tensor | None:
        """Run F; return the activation to send (None on the last virtual stage). From here on the
        stash keeps the output's graph, not its values (:mod:`megatron.pipeline.runtime.freed_outputs`)."""
        key = (op.microbatch, op.chunk)
        batch = self._batch(op)
        x = None if received is None else received.detach().requires_grad_(True)
        self.params_ready()
        self._fwd_version[key] = self.weights.before_forward(op)
        with self._rng.scope(), self.meter.record(key):
            out = self.setup.chunks[op.chunk](x, batch)
            if self.layout.is_last(self.stage, op.chunk):
                loss, num_tokens = self.setup.loss_fn(out, batch)
                if op.microbatch in self.setup.inject_nonfinite_losses:
                    loss = loss * float("nan")
                self._losses[key] = (loss.detach(), num_tokens)
                if self.setup.aux_loss_fn is not None:
                    with torch.no_grad():
                        aux = self.setup.aux_loss_fn(out, batch)
                    if aux is not None:
                        self._aux_losses[key] = aux.detach()
                out = loss / self.setup.microbatches_per_update
        if self.layout.is_last(self.stage, op.chunk):
            self._stash[key] = (x, out, False)
            return None
        sent = out.detach()  # the receiver's values: the send (or the next stage) holds them from here on
        self._stash[key] = (x, out, release_output(out))
        return sent

    # -- evaluation --------------------------------------------------------------------
    def begin_evaluation(self, batch_fn: Callable[[int], Batch]) -> None:
        """Enter evaluation: EVAL ops read ``batch_fn`` (a validation or test split) and run
        the chunks in eval mode (no dropout, so no RNG is drawn and training resumes on
        exactly the random stream it would have had without evaluation)."""
        if self._stash or self._deferred:
            raise RuntimeError(f"stage {self.stage}: evaluation needs a drained pipeline, "
                               f"{len(self._stash) + len(self._deferred)} micro-batches are in flight")
        self.weights.restore_current()
        self._eval_batch_fn = batch_fn
        self._eval_loss_sum = 0.0
        self._eval_tokens = 0
        self._was_training = [chunk.training for chunk in self.setup.chunks]
        for chunk in self.setup.chunks:
            chunk.eval()

    def eval_forward(self, op: Op, received: torch.Tensor | None) -> torch.Tensor | None:
        """EVAL: a forward without autograd; the last stage adds up token-weighted losses."""
        batch = self._batch(op, self._eval_batch_fn)
        with torch.no_grad():
            out = self.setup.chunks[op.chunk](received, batch)
            if not self.layout.is_last(self.stage, op.chunk):
                return out
            loss, num_tokens = self.setup.loss_fn(out, batch)
        self._eval_loss_sum += float(loss) * num_tokens
        self._eval_tokens += num_tokens
        return None

    def end_evaluation(self) -> tuple[float, int]:
        """Leave evaluation; return (sum of token-weighted losses, tokens), zeros off the last stage."""
        for chunk, training in zip(self.setup.chunks, self._was_training):
            chunk.train(training)
        return self._eval_loss_sum, self._eval_tokens

    def discard_forward(self, op: Op) -> None:
        """DISCARD: forget a forward that ran on invalid weights (post-validation re-runs it)."""
        key = (op.microbatch, op.chunk)
        if key not in self._stash:
            raise RuntimeError(f"stage {self.stage}: {op} but micro-batch {op.microbatch} "
                               f"(chunk {op.chunk}) has no stashed forward")
        del self._stash[key]
        self._fwd_version.pop(key, None)
        self._losses.pop(key, None)
        self._aux_losses.pop(key, None)
        self.meter.release(key)

    def backward(self, op: Op, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """Run a fused backward (BW); return the input gradient to send (None on the first)."""
        return self._backward(op, grad_output, defer=False)

    def backward_input(self, op: Op, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """Run B: the backward with weight gradients deferred to W; return what BW returns."""
        return self._backward(op, grad_output, defer=True)

    def weight_grad(self, op: Op) -> None:
        """Run W: the weight gradients B deferred for this micro-batch and chunk."""
        key = (op.microbatch, op.chunk)
        deferred = self._deferred.pop(key, None)
        if deferred is None:
            raise RuntimeError(f"stage {self.stage}: {op} has no preceding B of its micro-batch")
        with self._grad_scope(op, completes=True):
            deferred.run()
        self.meter.release(key)

    def _grad_scope(self, op: Op, completes: bool) -> contextlib.AbstractContextManager[None]:
        """Tell the overlapped reduction (if any) that ``op`` accumulates gradients."""
        if not self._grad_ops_synced:
            return contextlib.nullcontext()
        assert self.grad_sync is not None
        return self.grad_sync.grad_op(op, self.setup.microbatches_per_update, completes)

    def _backward(self, op: Op, grad_output: torch.Tensor | None, defer: bool) -> torch.Tensor | None:
        key = (op.microbatch, op.chunk)
        x, out, released = self._stash.pop(key)
        self.params_ready()
        version = self.weights.before_backward(op)
        scaler = self.setup.loss_scaler
        with self._grad_scope(op, completes=not defer), self._rng.scope(), \
                (defer_weight_grads() if defer else contextlib.nullcontext()) as deferred:
            if grad_output is None:
                torch.autograd.backward(out if scaler is None else out * scaler.scale)
            else:
                if self._stage_local_scaling:  # arrives unscaled in fp32: apply this stage's scale
                    grad_output = (grad_output * scaler.scale).to(out.dtype)
                (backward_released if released else torch.autograd.backward)(out, grad_output)
        self.weights.after_backward(op)
        if deferred is None:
            self.meter.release(key)
        else:
            self._deferred[key] = deferred
            self.meter.retain_only(key, deferred.tensors())
        drift = version - self._fwd_version.pop(key)
        self._drifts.append(drift)
        self.drift_histogram[drift] += 1
        if x is None:
            return None
        if self._stage_local_scaling and x.grad is not None:
            return x.grad.float() * scaler.inv_scale
        return x.grad

    def grad_sq_norm(self, op: Op) -> float:
        """This stage's squared gradient norm before update ``op`` (inf/nan if not finite)."""
        if self._deferred:
            mb, chunk = min(self._deferred)
            raise RuntimeError(
                f"stage {self.stage}: {op} while the weight gradients of micro-batch {mb} "
                f"(chunk {chunk}) are still deferred (its W has not run)"
            )
        if op.update in self.setup.inject_nonfinite_updates:
            for p in self.setup.optimizer.parameters():
                if p.grad is not None:
                    p.grad.view(-1)[0] = float("nan")
                    break
        if self.setup.tp_group is not None:  # the whole stage's norm, the same on every TP rank
            sharded_norm = self.setup.optimizer.tp_grad_sq_norm(self.setup.tp_group)  # distributed optimizer
            if sharded_norm is not None:  # each DP replica averaged only its range of the gradients
                return self.unscale_sq(float(sharded_norm))
            params = counted(self.setup.optimizer.parameters())  # a tied embedding once
            return self.unscale_sq(tp_sq_sum(((p, p.grad) for p in params), self.setup.tp_group))
        return self.unscale_sq(float(self.setup.optimizer.grad_sq_norm()))

    def apply_update(self, op: Op, stage_sq_norms: list[float]) -> None:
        """OPT: step with the norm over ``stage_sq_norms`` (all stages if sync, else own).

        Non-finite gradients skip the update (the version does not advance) and are logged.
        """
        tracer = self.hooks.tracer
        start = tracer.now() if tracer is not None else 0  # after the collective: see tracing
        total_sq = math.fsum(stage_sq_norms)
        opt = self.setup.optimizer
        self.params_ready()
        self.weights.before_update(op)
        if not math.isfinite(total_sq):
            self.record_update(op.update, total_sq, None)
        else:
            norm = math.sqrt(total_sq)
            scale = opt.clip_coef(norm, self.setup.clip_grad) if self.setup.clip_grad > 0 else 1.0
            lr = self.setup.lr_schedule.lr(opt.step_count + 1)
            # The grads are zeroed below: an optimizer may overwrite them (the fused kernel scales in place).
            opt.step_consuming_grads(lr, grad_scale=scale * self.inv_loss_scale)
            self.record_update(op.update, total_sq, lr)
        self.update_loss_scale(not math.isfinite(total_sq))
        if type(self.weights).after_update is not WeightPolicy.after_update:  # reads the new weights
            self.params_ready()
        self.weights.after_update(op)
        opt.zero_grad()
        if tracer is not None:
            tracer.record(op, start)

    def record_update(self, update: int, total_sq: float, lr: float | None) -> None:
        """Statistics of update ``update``: applied with ``lr``, or skipped when ``lr`` is None."""
        self._updates += 1
        scale = {} if self.setup.loss_scaler is None else {"loss_scale": self.setup.loss_scaler.scale}
        if lr is None:
            self._skipped += 1
            self._last_norm = math.nan  # not 0.0: the gradients were not finite
            self.update_log.append({"update": update, "skipped": True, **scale})
            print(
                f"[megatron-async] stage {self.stage}: skipped update {update} "
                f"(non-finite gradients, squared norm {total_sq}); weights unchanged",
                file=sys.stderr, flush=True,
            )
        else:
            norm = math.sqrt(total_sq)
            self._last_lr, self._last_norm = lr, norm
            self.update_log.append({"update": update, "skipped": False, "lr": lr, "grad_norm": norm, **scale})

    def take_report(self, update: int) -> StageReport:
        """Statistics since the previous report; resets the interval."""
        a = self.setup.microbatches_per_update
        done = [key for key in self._losses if key[0] // a <= update]
        taken = [self._losses.pop(key) for key in done]
        loss_sum = float(torch.stack([loss for loss, _ in taken]).sum()) if taken else 0.0
        aux = [self._aux_losses.pop(key) for key in done if key in self._aux_losses]
        mem = torch.cuda.max_memory_allocated(self.setup.device) if self.setup.device.type == "cuda" else 0
        report = StageReport(
            stage=self.stage,
            update=update,
            updates=self._updates,
            skipped=self._skipped,
            loss_sum=loss_sum,
            loss_count=len(taken),
            tokens=sum(tokens for _, tokens in taken),
            lr=self._last_lr,
            grad_norm=self._last_norm,
            drift_max=max(self._drifts, default=0),
            drift_sum=sum(self._drifts),
            drift_count=len(self._drifts),
            act_peak_count=self.meter.peak_count,
            act_peak_bytes=self.meter.peak_bytes,
            mem_peak_bytes=int(mem),
            loss_scale=1.0 if self.setup.loss_scaler is None else self.setup.loss_scaler.scale,
            param_sq=self._param_sq() if self.setup.report_params_norm else 0.0,
            aux_loss_sum=float(torch.stack(aux).sum()) if aux else 0.0,
            aux_loss_count=len(aux),
        )
        self._reset_interval()
        return report


Workers = Mapping[int, StageWorker] | Sequence[StageWorker]
"""The local stages' workers, indexed by stage (a list when every stage is local)."""

__all__ = ["Batch", "StageSetup", "StageWorker", "Workers"]
