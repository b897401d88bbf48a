"""Which weights a stage's forward and backward read: per-schedule weight-version policies.

By default a stage computes with its live parameters, which the optimizer updates in place
through ``p.data``; a backward that runs after an update therefore reads the newer weights
(PipeDream without stashing, PACI). Schedules that need other weights in a pass plug a
:class:`WeightPolicy` into the :class:`~megatron.pipeline.runtime.worker.StageWorker`:

* :class:`DoubleBufferedWeights` (PipeDream-2BW): the micro-batches of accumulation window
  ``w`` run forward *and* backward on version ``w - 1``; one stashed copy per stage.
* :class:`DiscrepancyCorrection` (PipeMare T2): a backward reads ``w - d * delta``, ``d`` its delay.

Schedules do not build these: they describe the policy of each stage with a torch-free spec
(:mod:`megatron.pipeline.weight_policy`), and :func:`build_weight_policy` makes the policy
from it where the stage's worker is set up.

All of them work with stock PyTorch by changing the *contents* of each parameter's storage
(``p.data.copy_``), never the storage itself: the tensors autograd saved in the forward
(the parameter or views of it) share that storage, so a backward sees exactly the values the
policy put there, and no version counter is bumped. The optimizer always sees the current
weights: :meth:`WeightPolicy.before_update` restores them first.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from megatron.pipeline.ir import Op
from megatron.pipeline.weight_policy import DiscrepancyCorrected, DoubleBuffered, WeightPolicySpec


def _swap_contents(params: list[torch.nn.Parameter], other: list[torch.Tensor]) -> None:
    """Exchange the values of ``params`` and ``other`` in place, one parameter at a time, so the
    transient buffer is one parameter, not a third copy of the stage's weights."""
    with torch.no_grad():
        for p, o in zip(params, other):
            tmp = p.data.clone()
            p.data.copy_(o)
            o.copy_(tmp)


class WeightPolicy:
    """Default policy: every pass reads the live weights; versions are update counts.

    ``version`` labels are the stage optimizer's ``step_count`` (applied updates). Hooks
    return the label of the weights the pass reads, so the worker's drift statistic is
    measured on what was actually read.
    """

    def __init__(self, params: list[torch.nn.Parameter], optimizer: Any):
        self.params = params
        self.optimizer = optimizer
        self.peak_versions_alive = 1

    @property
    def current_version(self) -> int:
        return self.optimizer.step_count

    @property
    def versions_alive(self) -> int:
        """Full weight versions held by the stage (live weights included)."""
        return 1

    @property
    def extra_weight_bytes(self) -> int:
        """Persistent bytes beyond the live weights (stashes, correction buffers)."""
        return 0

    def before_forward(self, op: Op) -> int:
        return self.current_version

    def before_backward(self, op: Op) -> int:
        return self.current_version

    def after_backward(self, op: Op) -> None:
        pass

    def before_update(self, op: Op) -> None:
        pass

    def after_update(self, op: Op) -> None:
        pass

    def restore_current(self) -> None:
        """Make the live parameters the current weights (evaluation, checkpoints)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def _note_versions(self) -> None:
        self.peak_versions_alive = max(self.peak_versions_alive, self.versions_alive)


class DoubleBufferedWeights(WeightPolicy):
    """PipeDream-2BW's double buffering with ``a`` micro-batches per update.

    Window ``w`` (micro-batches ``w*a .. w*a + a - 1``) computes forward and backward on the
    weights *before* update ``w - 1``: at ``OPT`` for update ``u`` the current weights are
    copied into the stash (for window ``u + 1``) and then updated. Every backward of window
    ``u`` has run before ``OPT u`` (the step closes the window), so the previous stash is dead
    by then and at most two versions ever exist: the live (current) weights and the stash.
    Update ``u`` therefore applies the gradient computed on version ``u - 1`` to version ``u``:
    ``W(t+1) = W(t) - lr * grad f(W(t-1))``; window 0 (and a fresh run) uses ``W(0)``.

    The stash persists across drains, so the first window of the next segment continues the
    recursion; it is saved and restored with checkpoints (:meth:`state_dict`).
    """

    def __init__(self, params: list[torch.nn.Parameter], optimizer: Any, microbatches_per_update: int):
        super().__init__(params, optimizer)
        self.a = microbatches_per_update
        self._stash: list[torch.Tensor] | None = None
        self._stash_window = -1  # window that computes on the stash
        self._stash_version = -1
        self._last_update = -1  # index of the last OPT this stage ran
        self._live_is_stash = False

    @property
    def versions_alive(self) -> int:
        return 1 if self._stash is None else 2

    @property
    def extra_weight_bytes(self) -> int:
        return 0 if self._stash is None else sum(t.numel() * t.element_size() for t in self._stash)

    def _select(self, op: Op) -> int:
        """Put the weights of ``op``'s window in the live parameters; return their version."""
        window = op.microbatch // self.a
        use_stash = self._stash is not None and window == self._stash_window
        if not use_stash and self._last_update >= window - 1 >= 0:
            raise RuntimeError(
                f"pipedream-2bw: {op} needs the weights before update {window - 1}, which is no longer "
                f"held (two versions at most); the schedule must admit at most one update between a "
                f"window's first forward and its last backward")
        if use_stash != self._live_is_stash:
            assert self._stash is not None
            _swap_contents(self.params, self._stash)
            self._live_is_stash = use_stash
        return self._stash_version if use_stash else self.current_version

    before_forward = _select
    before_backward = _select

    def restore_current(self) -> None:
        if self._live_is_stash:
            assert self._stash is not None
            _swap_contents(self.params, self._stash)
            self._live_is_stash = False

    def before_update(self, op: Op) -> None:
        self.restore_current()
        with torch.no_grad():
            if self._stash is None:
                self._stash = [p.detach().clone() for p in self.params]
            else:
                for s, p in zip(self._stash, self.params):
                    s.copy_(p.data)
        self._stash_window, self._stash_version, self._last_update = op.update + 1, self.current_version, op.update
        self._note_versions()

    def state_dict(self) -> dict[str, Any]:
        self.restore_current()
        return {"stash": None if self._stash is None else [t.detach().cpu().clone() for t in self._stash],
                "stash_window": self._stash_window, "stash_version": self._stash_version,
                "last_update": self._last_update}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restore_current()
        if not state:  # a checkpoint without weight-version state: a fresh start
            return
        stash = state.get("stash")
        self._stash = None if stash is None else [t.to(p.device).clone() for t, p in zip(stash, self.params)]
        self._stash_window, self._stash_version = state["stash_window"], state["stash_version"]
        self._last_update = state["last_update"]
        self._note_versions()


class DiscrepancyCorrection(WeightPolicy):
    """PipeMare's T2: backwards read ``w - d * delta`` instead of the current ``w``.

    ``delta`` is a per-parameter velocity estimate, updated after every update of the stage:
    ``delta <- gamma * delta + (1 - gamma) * (w_new - w_old)``, ``gamma = D ** (1 / tau)``,
    ``delta_0 = 0``. ``tau = tau_fwd - tau_bkwd`` is the stage's forward/backward delay in
    updates (``tau_bkwd = 0`` here: the backward reads the latest weights). ``d``, the number of
    updates the backward extrapolates back over, is ``tau`` for every backward when
    ``measured_delay`` is False (the paper's fine-grained pipelines, where every micro-batch of
    a stage has the same delay); with ``measured_delay`` it is the updates this stage really
    applied between the micro-batch's forward and its backward (``0 <= d <= tau`` on a 1F1B
    stream: fewer while the pipeline fills, and with ``a > 1`` the delay alternates between
    ``floor`` and ``ceil`` of ``(N - 1 - s) / a``), so a backward whose forward read the current
    weights is never moved away from them. Backwards of micro-batches whose iteration is below
    ``sync_until`` (PipeMareW's synchronous warm-up, where forward and backward read the same
    weights) are not corrected, but ``delta`` is updated from the first update on, so it is
    warm when asynchrony starts.

    Exactness: the current weights are copied aside for the corrected backward and copied
    back after it (``w - d*delta + d*delta`` would not round-trip in floating point);
    that copy is transient, the persistent cost is ``delta`` (one weight copy, fp32 or the
    parameter dtype).
    """

    def __init__(self, params: list[torch.nn.Parameter], optimizer: Any, tau: int, decay: float,
                 microbatches_per_update: int, sync_until: int = 0, measured_delay: bool = False):
        super().__init__(params, optimizer)
        if tau < 1:
            raise ValueError(f"discrepancy correction needs a delay tau >= 1, got {tau}")
        self.tau, self.gamma = tau, decay ** (1.0 / tau)
        self.a, self.sync_until = microbatches_per_update, sync_until
        self.measured_delay = measured_delay
        self.delta = [torch.zeros_like(p, dtype=torch.float32 if p.dtype in (torch.bfloat16, torch.float16)
                                       else p.dtype) for p in params]
        self._saved: list[torch.Tensor] | None = None
        self._before: list[torch.Tensor] | None = None
        self._forward_versions: dict[int, int] = {}  # micro-batch -> version its forward read

    @property
    def extra_weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.delta)

    def corrected(self, steps: int | None = None) -> Iterator[torch.Tensor]:
        """The backward weights ``w - steps * delta`` (``steps`` defaults to ``tau``), in each
        parameter's dtype, one parameter at a time: a caller that writes each into place holds one
        parameter's worth transiently, not a second copy of the stage's weights."""
        steps = self.tau if steps is None else steps
        return ((p.detach().to(d.dtype) - steps * d).to(p.dtype) for p, d in zip(self.params, self.delta))

    def before_forward(self, op: Op) -> int:
        if self.measured_delay:
            self._forward_versions[op.microbatch] = self.current_version
        return self.current_version

    def before_backward(self, op: Op) -> int:
        steps = self.tau
        if self.measured_delay:
            steps = self.current_version - self._forward_versions.pop(op.microbatch)
        if op.microbatch // self.a >= self.sync_until and steps > 0:
            with torch.no_grad():
                self._saved = [p.detach().clone() for p in self.params]
                for p, u in zip(self.params, self.corrected(steps)):
                    p.data.copy_(u)
        return self.current_version

    def after_backward(self, op: Op) -> None:
        self.restore_current()

    def restore_current(self) -> None:
        if self._saved is not None:
            with torch.no_grad():
                for p, w in zip(self.params, self._saved):
                    p.data.copy_(w)
            self._saved = None

    def before_update(self, op: Op) -> None:
        self.restore_current()
        self._before = [p.detach().to(d.dtype).clone() for p, d in zip(self.params, self.delta)]

    def after_update(self, op: Op) -> None:
        assert self._before is not None
        with torch.no_grad():
            for p, d, old in zip(self.params, self.delta, self._before):
                d.mul_(self.gamma).add_(p.detach().to(d.dtype) - old, alpha=1.0 - self.gamma)
        self._before = None

    def state_dict(self) -> dict[str, Any]:
        return {"delta": [d.detach().cpu().clone() for d in self.delta]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for d, saved in zip(self.delta, state["delta"]):
                d.copy_(saved)


def build_weight_policy(spec: WeightPolicySpec | None, optimizer: Any) -> WeightPolicy | None:
    """The policy ``spec`` describes, over ``optimizer``'s parameters (None: the live weights,
    the worker's default :class:`WeightPolicy`)."""
    if spec is None:
        return None
    params = optimizer.parameters()
    if isinstance(spec, DoubleBuffered):
        return DoubleBufferedWeights(params, optimizer, spec.microbatches_per_update)
    if isinstance(spec, DiscrepancyCorrected):
        return DiscrepancyCorrection(params, optimizer, spec.tau, spec.decay, spec.microbatches_per_update,
                                     sync_until=spec.sync_until, measured_delay=spec.measured_delay)
    raise TypeError(f"no weight policy implements {spec!r}")
