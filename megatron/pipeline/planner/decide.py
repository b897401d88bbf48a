"""``auto``'s decision as one pure function: ``decide(profile, candidates, limits) -> Decision``.

Why one function: the decision has three inputs of different origin, and keeping them apart
keeps the seam between the planner and the trainer narrow. The *profile* is what the run
measured (or was given: ``--zb-costs``), per stage. The *candidates* are what the built run can
switch to: the schedules of its own chain (:func:`~.runtime_choice.switchable`) and the layouts
the trainer can rebuild it in (:class:`~.relayout.Relayout`, priced from the chain's profile with
its layers per stage). The *limits* are the host's: the activation-memory limit in ``M_B`` and
the cores a CPU host's pipeline shares. Everything here is pure Python (no torch): the trainer's
adapter (:mod:`megatron.trainer.loop.auto`) computes the candidates and limits, and
:class:`~.auto_schedule.AutoSchedule` calls :func:`decide` with its profile.

The rule: rank every fitting candidate (:func:`~.runtime_choice.rank_choices`), then take the
first, unless it needs a rebuild and beats the best schedule of the run's own chain by no more
than :data:`RELAYOUT_MARGIN` (a rebuild costs a checkpoint's round trip, and its parts are
priced, not measured). A checkpoint's earlier decision (``chosen``) wins over a re-ranking, so a
resumed run keeps what it chose.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron.pipeline.costs.op_costs import OpCosts
from megatron.pipeline.planner.relayout import Relayout
from megatron.pipeline.planner.runtime_choice import Choice, rank_choices
from megatron.pipeline.schedules.base import ScheduleConfig, ScheduleConfigError

#: how much faster (simulated) a rebuilt layout must be than the best schedule of the run's own
#: chain to be chosen: the rebuild's checkpoint round trip, and the pricing of parts from a
#: chain's stages (module docstring of :mod:`~megatron.pipeline.planner.relayout`)
RELAYOUT_MARGIN = 0.02


@dataclass(frozen=True)
class Candidates:
    """What a built run can switch to: ``config`` is its chain (stages, micro-batches, replicas,
    first iteration), ``include_async`` whether asynchronous schedules may be chosen
    (``auto-async``), ``relayouts`` the layouts the trainer can rebuild it in, priced with the
    chain's ``stage_layers`` (layers per stage) and, under a memory limit, ``stage_bytes`` (the
    chain's activation bytes of one micro-batch per stage)."""

    config: ScheduleConfig
    include_async: bool = False
    relayouts: tuple[Relayout, ...] = ()
    stage_layers: tuple[int, ...] = ()
    stage_bytes: tuple[float, ...] = ()


@dataclass(frozen=True)
class Limits:
    """The host's bounds on the choice: ``memory`` in ``M_B`` (None: none), the ``host_cores``
    one pipeline's stages share on a CPU host (None: a device per stage), and the ``margin`` a
    rebuild must win by."""

    memory: float | None = None
    host_cores: float | None = None
    margin: float = RELAYOUT_MARGIN


@dataclass(frozen=True)
class Decision:
    """The chosen candidate (``best``), every fitting one best first (``ranked``), and one line
    per candidate that cannot run or does not fit (``refused``)."""

    best: Choice
    ranked: tuple[Choice, ...]
    refused: tuple[str, ...]

    @property
    def relayout(self) -> Relayout | None:
        """The layout to rebuild the run in; None: the run's own chain runs the choice."""
        return self.best.relayout


def pick(ranked: Sequence[Choice], margin: float = RELAYOUT_MARGIN) -> Choice:
    """The first of ``ranked``, unless it needs a rebuild and does not beat the best choice on
    the run's own chain by ``margin``."""
    in_place = next((c for c in ranked if c.relayout is None), None)
    best = ranked[0]
    if best.relayout is not None and in_place is not None \
            and best.iteration_time * (1 + margin) > in_place.iteration_time:
        return in_place
    return best


def decide(profile: Sequence[OpCosts], candidates: Candidates, limits: Limits,
           chosen: str | None = None) -> Decision:
    """Rank ``candidates`` with the per-stage ``profile`` within ``limits`` and choose (module
    docstring); ``chosen``: a checkpoint's decision by its label, kept instead of re-ranking.
    :class:`ScheduleConfigError` (one line) when nothing fits, or ``chosen`` cannot run here."""
    ranked, refused = rank_choices(candidates.config, profile, limits.memory, candidates.include_async,
                                   limits.host_cores, candidates.relayouts, candidates.stage_layers,
                                   candidates.stage_bytes)
    if not ranked:
        raise ScheduleConfigError(f"no schedule fits the memory limit {limits.memory} M_B: " + "; ".join(refused))
    best = pick(ranked, limits.margin) if chosen is None else next((c for c in ranked if c.label == chosen), None)
    if best is None:
        raise ScheduleConfigError(f"the checkpoint's choice {chosen} cannot run here")
    return Decision(best, tuple(ranked), tuple(refused))
