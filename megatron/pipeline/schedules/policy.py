"""What the runtime, the optimizer, checkpointing and the start's banner need from a schedule.

A schedule is an order (its streams over a layout), a check (``check_config``) and this
policy: one frozen record, so a consumer reads a declared field instead of overriding or
probing a hook. A schedule class gives its policy for a config (``traits.policy_for``: what
the trainer needs before building it: layout, weights, learning rate, sharding, reshard);
an instance's policy (``Schedule.policy``) adds what it decides while running, as callables
bound to it (a profiled order's checkpoint state, whether the executors still time ops, the
start's lines) and post-validation's outcomes.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron.pipeline.ir import Op, PipelineLayout
from megatron.pipeline.schedules.config import ScheduleConfigError
from megatron.pipeline.schedules.zero_bubble.post_validation import PostValidation
from megatron.pipeline.weight_policy import WeightPolicySpec

#: a stage's learning-rate rule: the stage's schedule from the run's base schedule
StageLR = Callable[[Any], Any]


@dataclass(frozen=True)
class OptimizerSharding:
    """Whether each stage replica's optimizer keeps only its share of the state (ZeRO-1 over
    the replicas a schedule places).

    ``shard``: True asks for it (``refusal`` is the error when the optimizer's state is not
    element-wise), None takes it where the optimizer allows, False never shards.
    """

    shard: bool | None = False
    refusal: str = ""

    def decide(self, shardable: bool) -> bool:
        """Whether to shard, given that the optimizer's state can be split (``shardable``)."""
        if self.shard is None:
            return shardable
        if self.shard and not shardable:
            raise ScheduleConfigError(self.refusal)
        return self.shard


def _no_state() -> dict[str, Any] | None:
    return None


def _ignore_state(state: dict[str, Any]) -> None:
    """A schedule that decides nothing at run time ignores what a checkpoint holds for it."""


@dataclass(frozen=True)
class CheckpointCodec:
    """What a schedule decided during the run and a resumed run must keep (a profiled order's
    costs): ``save()`` gives it as plain data (None: nothing), ``restore(state)`` takes it back.
    The data is stored as is in the checkpoint (``schedule_state``), so its format is the
    schedule's on-disk format."""

    save: Callable[[], dict[str, Any] | None] = _no_state
    restore: Callable[[dict[str, Any]], None] = _ignore_state


def _no_lines() -> list[str] | None:
    return None


def _never() -> bool:
    return False


def _never_overlapped(op: Op) -> bool:
    return False


@dataclass(frozen=True)
class SchedulePolicy:
    """A schedule's policy (module docstring). Per-stage fields are indexed by stage.

    * ``layout``: where model chunks go (the trainer builds stages from it);
    * ``weight_copies``: weight-sized buffers a stage holds at peak, its live weights included
      (2BW's stash, PipeMare's delta add one; an AMDP device hosts D/2 stage replicas);
    * ``weight_policies``: which weights a stage's passes read, as a spec the runtime builds
      (:mod:`megatron.pipeline.weight_policy`); None: the live weights;
    * ``stage_lr``: a stage's learning-rate rule over the run's schedule; None keeps it;
    * ``stashes_weights``: every backward reads the weight version its forward read;
    * ``weight_policy_has_state``: the weight policy holds state a checkpoint saves, which
      resumes only into the same partition and schedule (reset, with a notice, otherwise);
    * ``optimizer_sharding``: :class:`OptimizerSharding`;
    * ``post_validation``: post-validation's outcomes (:class:`PostValidation`) when the
      streams carry VALIDATE ops; None: not post-validated;
    * ``reshard_refusal``: set (to the reason) when a checkpoint can only resume into the
      layout it was saved from;
    * ``checkpoint``: :class:`CheckpointCodec`;
    * ``fixed_costs``: the per-stage costs the order was decided from up front, so the start
      logs its simulated bubble (None: none, or still to be profiled);
    * ``start_lines()``: lines the start logs about how the order was chosen (``auto``); None:
      the simulated bubble of ``fixed_costs`` instead, if any;
    * ``profiles_ops()``: whether the executors time the ops now (an order still to be decided
      from measured costs);
    * ``overlapped_backward(op)``: ``op`` is the backward of an overlapped F&B slot
      (DualPipeV's), which the timing simulator may shorten;
    * ``fixed_accumulation``: why the stages' weight or learning-rate rules are built once from
      the run's micro-batches per update, so a batch-size rampup cannot change them (None: it
      can, segment by segment);
    * ``gradient_delays``: the declared bound, in the stage's own updates, on how many updates
      separate the weights a stage's gradient was computed on from the weights it is applied to
      (its weight-version drift bound; what a delay-aware optimizer adapts to). None: not
      declared (synchronous schedules: no delay).
    """

    layout: PipelineLayout
    weight_copies: tuple[int, ...]
    weight_policies: tuple[WeightPolicySpec | None, ...]
    stage_lr: tuple[StageLR | None, ...]
    stashes_weights: bool = False
    weight_policy_has_state: bool = False
    optimizer_sharding: OptimizerSharding = field(default_factory=OptimizerSharding)
    post_validation: PostValidation | None = None
    reshard_refusal: str | None = None
    checkpoint: CheckpointCodec = field(default_factory=CheckpointCodec)
    fixed_costs: tuple[Any, ...] | None = None
    start_lines: Callable[[], list[str] | None] = _no_lines
    profiles_ops: Callable[[], bool] = _never
    overlapped_backward: Callable[[Op], bool] = _never_overlapped
    fixed_accumulation: str | None = None
    gradient_delays: tuple[int, ...] | None = None

    @classmethod
    def plain(cls, layout: PipelineLayout) -> SchedulePolicy:
        """Live weights in one copy and the run's learning rate on every stage of ``layout``."""
        n = layout.num_stages
        return cls(layout, weight_copies=(1,) * n, weight_policies=(None,) * n, stage_lr=(None,) * n)

    def lr_schedule(self, stage: int, base: Any) -> Any:
        """The learning-rate schedule of ``stage`` given the run's ``base`` schedule."""
        rule = self.stage_lr[stage]
        return base if rule is None else rule(base)

    @property
    def post_validated(self) -> bool:
        """Whether the streams carry post-validation's VALIDATE ops."""
        return self.post_validation is not None

    @property
    def adds_weight_or_lr_policy(self) -> bool:
        """Whether some stage reads other than its live weights, holds extra weight copies or
        rescales its learning rate: a run built for a schedule without any can switch to it."""
        return (any(c != 1 for c in self.weight_copies) or any(p is not None for p in self.weight_policies)
                or any(r is not None for r in self.stage_lr))
