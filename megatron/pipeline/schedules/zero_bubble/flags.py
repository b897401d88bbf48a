"""Flags of the automatic Zero Bubble schedules (``zb-1p`` / ``zb-2p``), declared once for both.

``--zb-profile-iters K`` (default 2): the first K iterations run ZB-H1 while every stage times
its F, B and W ops; the order of the remaining iterations is decided from the profiled costs
(:mod:`.profiled`, :mod:`megatron.pipeline.runtime.profiling`). ``--zb-costs
T_F,T_B,T_W,T_COMM[,M_W/M_B]`` fixes the costs instead (no profiling, every iteration runs the
same order), which makes an emulator run bitwise comparable with a distributed one;
``--zb-profile-iters 0`` without it uses placeholder costs (all times 1, no communication,
``M_W / M_B = 1``). ``--zb-memory-limit X`` replaces the schedule's activation-memory limit
(``N`` resp. ``2N`` times ``M_B``).
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron.pipeline.schedules.config import ScheduleConfig, ScheduleConfigError, ScheduleOptions, options_as
from megatron.pipeline.schedules.options import Flag, FlagGroup, OptionFields
from megatron.pipeline.schedules.zero_bubble.post_validation_flags import PostValidationOptions
from megatron.pipeline.costs.op_costs import UNPROFILED_M_W, OpCosts, costs_from_profile, load_profile

DEFAULT_PROFILE_ITERS = 2


@dataclass(frozen=True)
class ZeroBubbleOptions(PostValidationOptions):
    """The options of the schedules whose order the greedy search decides (zb-1p, zb-2p, zb-v)
    from ``costs`` (:class:`ScheduleOptions`).

    ``memory_limit``: the search's activation-memory limit in ``M_B`` (None: the schedule's
    default). ``profile_iters``: the first K iterations profile the costs the order is then
    decided from (0: no profiling).
    """

    memory_limit: float | None = None
    profile_iters: int = 0


def profile_iterations(options: ScheduleOptions) -> int:
    """The iterations ``options`` profile before deciding an order (0: none, or not a Zero
    Bubble schedule's options)."""
    return options.profile_iters if isinstance(options, ZeroBubbleOptions) else 0


def memory_limit_of(options: ScheduleOptions) -> float | None:
    """The activation-memory limit ``options`` set (None: none set, or not a Zero Bubble
    schedule's options)."""
    return options.memory_limit if isinstance(options, ZeroBubbleOptions) else None


def memory_limited(kind: type[ScheduleOptions], limit: float | None) -> ScheduleOptions:
    """Default options of a schedule whose options type is ``kind``, with the activation-memory
    ``limit`` where it takes one (a Zero Bubble search); other schedules have no limit to set."""
    if limit is None or not issubclass(kind, ZeroBubbleOptions):
        return kind()
    return kind(memory_limit=float(limit))


def without_order_costs(options: ScheduleOptions) -> ScheduleOptions:
    """``options`` without the costs and profiling an order is decided from (the rest, a
    memory limit, kept)."""
    if isinstance(options, ZeroBubbleOptions):
        return dataclasses.replace(options, costs=None, profile_iters=0)
    return dataclasses.replace(options, costs=None)


def with_order_costs(options: ScheduleOptions, kind: type[ScheduleOptions], costs: Any) -> ScheduleOptions:
    """``options`` read as a schedule's whose options type is ``kind``, with ``costs``."""
    return dataclasses.replace(options_as(options, kind), costs=costs)


def parse_costs(text: str, num_stages: int) -> tuple[OpCosts, ...]:
    """``--zb-costs``: ``T_F,T_B,T_W,T_COMM[,M_W/M_B]`` or a JSON profile file: the format of
    :func:`megatron.pipeline.costs.op_costs.costs_from_profile` (per-stage costs under ``"stages"``),
    or the object the trainer logs after profiling (``zero-bubble-schedule {...}``, per-stage
    costs under ``"costs"``). Returns one :class:`OpCosts` per stage; ValueError (one line)."""
    if "," not in text and (text.endswith(".json") or os.path.isfile(text)):
        try:
            profile = load_profile(text)
            if isinstance(profile.get("costs"), list):  # the trainer's logged zero-bubble-schedule object
                profile = {"stages": profile["costs"]}
            return costs_from_profile({"m_w": UNPROFILED_M_W, **profile}, num_stages)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"--zb-costs {text}: {exc}") from None
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (4, 5):
        raise ValueError(f"--zb-costs expects T_F,T_B,T_W,T_COMM[,M_W/M_B] or a JSON profile file, got {text!r}")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--zb-costs expects numbers, got {text!r}") from None
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise ValueError(f"--zb-costs values must be finite and >= 0, got {text!r}")
    if values[0] + values[1] + values[2] <= 0:
        raise ValueError(f"--zb-costs: T_F + T_B + T_W must be positive, got {text!r}")
    if len(values) == 5 and values[4] > 1:
        raise ValueError(f"--zb-costs: M_W/M_B must be <= 1 (W keeps part of a micro-batch's activations), got {values[4]}")
    m_w = values[4] if len(values) == 5 else UNPROFILED_M_W
    return (OpCosts(values[0], values[1], values[2], t_comm=values[3], m_w=m_w),) * num_stages


def zero_bubble_options(values: Mapping[str, Any], config: ScheduleConfig) -> OptionFields:
    """:class:`ZeroBubbleOptions`' fields: ``costs`` (fixed or placeholder), ``memory_limit`` if
    given, ``profile_iters`` (``--zb-profile-iters`` resolved against ``--zb-costs``)."""
    iters, text, limit = values["zb_profile_iters"], values["zb_costs"], values["zb_memory_limit"]
    if iters is not None and iters < 0:
        raise ScheduleConfigError(f"--zb-profile-iters must be >= 0, got {iters}")
    costs: Any = OpCosts(m_w=UNPROFILED_M_W)
    if text is not None:
        if iters:
            raise ScheduleConfigError(
                f"--zb-costs fixes the costs; it excludes profiling (--zb-profile-iters {iters}); drop one")
        try:
            costs = parse_costs(text, config.num_stages)
        except ValueError as exc:
            raise ScheduleConfigError(str(exc)) from None
        iters = 0
    if limit is not None and not (math.isfinite(limit) and limit >= 1):
        raise ScheduleConfigError(
            f"--zb-memory-limit must be at least 1 (one micro-batch's activations, M_B), got {limit}")
    iters = DEFAULT_PROFILE_ITERS if iters is None else iters
    return {"costs": costs, "memory_limit": None if limit is None else float(limit), "profile_iters": int(iters)}


ZERO_BUBBLE_FLAGS = FlagGroup("zero bubble", (
    Flag("--zb-profile-iters", type=int, metavar="K",
         help=f"run ZB-H1 for the first K iterations while timing F, B and W, then the schedule searched "
              f"with those costs (default {DEFAULT_PROFILE_ITERS}; 0: use --zb-costs or the placeholder "
              f"costs T_F = T_B = T_W = 1, T_comm = 0, M_W/M_B = 1)"),
    Flag("--zb-costs", metavar="T_F,T_B,T_W,T_COMM[,M_W/M_B] | PROFILE.json",
         help="fixed costs (ms; any unit works if it is the same for all four) and optionally the "
              f"activation memory W keeps relative to a micro-batch's (default {UNPROFILED_M_W:g}), or a JSON "
              "profile with per-stage costs (as logged after profiling); skips profiling, so emulator "
              "and distributed runs use the same order"),
    Flag("--zb-memory-limit", type=float, metavar="X",
         help="activation-memory limit of the schedule search, in units of one micro-batch's "
              "activations on a stage (M_B); default N (zb-1p) or 2N (zb-2p)"),
), zero_bubble_options)
