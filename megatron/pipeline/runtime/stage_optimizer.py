"""What the runtime asks of a stage's optimizer and learning-rate policy: the declared contract.

:class:`StageOptimizer` lists every member the worker, the transports, post-validation, the
weight policies and checkpoints call. Six are required (the abstract ones); the others have
defaults that fit an optimizer holding its stage's whole state on one rank, and the
distributed optimizer (:mod:`megatron.pipeline.runtime.distributed_optimizer`) overrides
them. Nothing in the runtime probes an optimizer with ``getattr``: it calls these members.
"""
from __future__ import annotations

import abc
from datetime import timedelta
from typing import Any, Protocol

import torch


class StageOptimizer(abc.ABC):
    """A stage's optimizer: steps on the stage's own clock, writes through ``p.data``."""

    #: Updates applied so far: the stage's weight version.
    step_count: int = 0
    #: True when this optimizer keeps state for only a part of its parameters (ZeRO-1 over
    #: AMDP's replicas or the data-parallel group); checkpoints and replicas ask it.
    sharded: bool = False

    # -- required ----------------------------------------------------------------------
    @abc.abstractmethod
    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameters this optimizer updates, in a fixed order."""

    @abc.abstractmethod
    def grad_sq_norm(self) -> torch.Tensor:
        """Sum of squares of the stage's gradients (a tensor: callers reduce it before syncing)."""

    @abc.abstractmethod
    def clip_coef(self, total_norm: float, max_norm: float) -> float:
        """The factor the gradients are scaled by for a total norm of ``total_norm``."""

    @abc.abstractmethod
    def step(self, lr: float, grad_scale: float = 1.0) -> None:
        """One update with learning rate ``lr`` on gradients times ``grad_scale``."""

    @abc.abstractmethod
    def rollback(self, lr: float, grad_scale: float = 1.0) -> None:
        """Undo the last :meth:`step` (post-validation's optimizer rollback)."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Zero (or drop) the gradients of :meth:`parameters`."""

    # -- optional, with defaults -------------------------------------------------------
    def step_consuming_grads(self, lr: float, grad_scale: float = 1.0) -> None:
        """:meth:`step` for a caller that zeroes the gradients right after (the runtime's OPT):
        an optimizer may then overwrite them. Default: a plain :meth:`step`."""
        self.step(lr, grad_scale)

    def roll_back_exactly(self, params: list[torch.nn.Parameter]) -> None:
        """Make :meth:`rollback` restore ``params`` bitwise (post-validation's tied embedding
        ends: one stage may roll back a step its other end's stage never took). Default: refuse,
        for an optimizer whose rollback is not built on backups."""
        raise NotImplementedError(f"{type(self).__name__} cannot roll back parameters exactly")

    def wait_params(self) -> None:
        """Block until the parameters are whole (an overlapped parameter all-gather). Default:
        they always are."""

    def tp_grad_sq_norm(self, tp_group: Any) -> torch.Tensor | None:
        """The whole stage's squared gradient norm at tensor parallelism > 1, when this optimizer
        computes it itself (the distributed optimizer holds only its range of the averaged
        gradients). Default None: the worker sums the parameters' gradients over ``tp_group``."""
        return None

    def attach(self, group: Any, timeout: timedelta) -> None:
        """Receive the stage's data-parallel group and the pipeline timeout (the transport owns
        the groups). Default: an optimizer that runs no collective ignores them."""

    def reduce_gradients(self) -> bool:
        """Average the gradients over the data-parallel group itself; return True when it did.
        Default False: the transport all-reduces them."""
        return False

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """:meth:`parameters` with their global names (checkpoints, AMDP's sharded state)."""
        raise NotImplementedError(f"{type(self).__name__} does not name its parameters")

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state."""
        raise NotImplementedError(f"{type(self).__name__} saves no state")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} loads no state")

    def full_state_dict(self) -> dict[str, Any]:
        """The whole stage's state as an unsharded optimizer saves it (a collective where the
        state is spread over ranks). Default: :meth:`state_dict`."""
        return self.state_dict()


class LRPolicy(Protocol):
    """A stage's learning rate as a function of its local update count (1-based)."""

    def lr(self, step: int) -> float: ...
