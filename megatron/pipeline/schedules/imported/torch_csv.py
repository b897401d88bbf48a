"""``--pipeline-schedule torch-csv:PATH``: replay a ``torch.distributed.pipelining`` compute-only CSV.

The whole order lives in :mod:`megatron.pipeline.torch_actions` (parsing, placement, the
schedule check); this module is the one small :class:`SynchronousSchedule` subclass that
replays it every iteration (then the pipeline-wide optimizer step), so adapting it to another
Schedule API touches this file only. Its dependencies on that API: ``SynchronousSchedule``
(its ``stage_ops`` yields ``iteration_ops`` then the sync OPT per iteration; its metaclass is
``abc.ABCMeta``, which ``_PerPathClass`` extends), ``name``, the class's ``traits`` (no flags,
several chunks per rank, a policy on the CSV's layout) and ``check_config``. The registry's hook is one prefix test in
``megatron.pipeline.schedules.schedule_class``.

The class is made per CSV path (:func:`torch_csv_class`, cached), named ``torch-csv:PATH`` so a
checkpoint's signature names it again, and the CSV is parsed and checked when it is made: a
broken order is refused in one line (rank and action) before any rank starts.
"""
from __future__ import annotations

import abc
import copyreg
import dataclasses
import functools
import os
from collections.abc import Iterator
from typing import ClassVar

from megatron.pipeline.ir import Op, PipelineLayout
from megatron.pipeline.schedules.base import ScheduleConfig, ScheduleConfigError, SynchronousSchedule
from megatron.pipeline.schedules.policy import SchedulePolicy
from megatron.pipeline.torch_actions import TorchOrder, TorchOrderError, check_order, read_csv

PREFIX = "torch-csv:"


class _PerPathClass(abc.ABCMeta):
    """The classes made per CSV pickle as ``torch_csv_class(name)`` (a run's config travels to
    its ranks pickled, with the schedule class in it); the base class by its name."""


def _reduce_class(cls: type) -> object:
    return (torch_csv_class, (cls.name,)) if "order" in cls.__dict__ else cls.__qualname__


copyreg.pickle(_PerPathClass, _reduce_class)


class TorchCSVSchedule(SynchronousSchedule, metaclass=_PerPathClass):
    """Every iteration runs :attr:`order` (micro-batches renumbered from the iteration's first)."""

    name = "torch-csv"
    # no flags (no post-validation: the CSV fixes where the steps are); the CSV's loop placement
    # may hold several chunks per rank; the policy's layout is the CSV's (set per path below)
    traits = dataclasses.replace(SynchronousSchedule.traits, flag_groups=(), takes_model_chunks=True)
    order: ClassVar[TorchOrder]

    @classmethod
    def check_config(cls, config: ScheduleConfig) -> None:
        super().check_config(config)
        order = cls.order
        if config.num_stages != order.num_ranks:
            raise ScheduleConfigError(f"{cls.name}: the CSV has {order.num_ranks} ranks, the pipeline "
                                      f"{config.num_stages} stages (--pipeline-model-parallel-size)")
        if config.num_microbatches != order.num_microbatches:
            raise ScheduleConfigError(f"{cls.name}: the CSV runs {order.num_microbatches} micro-batches per "
                                      f"iteration, the run {config.num_microbatches} (global batch / micro-batch size)")
        if config.num_chunks not in (1, order.layout.num_chunks):
            raise ScheduleConfigError(f"{cls.name}: the CSV holds {order.layout.num_chunks} stages per rank, "
                                      f"the run asks for {config.num_chunks} model chunks")

    def iteration_ops(self, stage: int, microbatches: range) -> Iterator[Op]:
        return self.order.iteration_ops(stage, microbatches.start)


@functools.lru_cache(maxsize=None)
def _class_for(path: str, mtime: float) -> type[TorchCSVSchedule]:
    try:
        order = read_csv(path)
        check_order(order, source=path)
    except TorchOrderError as exc:
        raise ScheduleConfigError(f"{PREFIX}{exc}") from None
    traits = dataclasses.replace(TorchCSVSchedule.traits, policy_for=functools.partial(_plain_on, order.layout))
    return type("TorchCSVSchedule", (TorchCSVSchedule,), {"name": PREFIX + path, "order": order, "traits": traits})


def _plain_on(layout: PipelineLayout, config: ScheduleConfig) -> SchedulePolicy:
    """The CSV's policy: live weights on the placement the CSV's stage-to-rank mapping gives."""
    return SchedulePolicy.plain(layout)


def torch_csv_class(name: str) -> type[TorchCSVSchedule]:
    """The schedule class of ``torch-csv:PATH`` (one-line :class:`ScheduleConfigError` if the CSV
    is missing or its order cannot run)."""
    path = name[len(PREFIX):]
    if not path:
        raise ScheduleConfigError(f"{PREFIX}PATH needs the path of a compute-only CSV")
    try:
        mtime = os.stat(path).st_mtime
    except OSError as exc:
        raise ScheduleConfigError(f"{name}: cannot read the schedule CSV ({exc.strerror})") from None
    return _class_for(path, mtime)
