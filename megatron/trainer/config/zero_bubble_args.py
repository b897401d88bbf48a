"""Flags of the automatic Zero Bubble schedules (``zb-1p`` / ``zb-2p``) and their validation.

``--zb-profile-iters K`` (default 2): the first K iterations run ZB-H1 while every stage times
its F, B and W ops; the order of the remaining iterations is decided from the profiled costs
(:mod:`megatron.pipeline.runtime.profiling`). ``--zb-costs T_F,T_B,T_W,T_COMM[,M_W/M_B]`` fixes the
costs instead (no profiling, every iteration runs the same order), which makes an emulator
run bitwise comparable with a distributed one; ``--zb-profile-iters 0`` without it uses
placeholder costs (all times 1, no communication, ``M_W / M_B = 1``). ``--zb-memory-limit X``
replaces the schedule's activation-memory limit (``N`` resp. ``2N`` times ``M_B``).
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Any

ZB_AUTO_SCHEDULES = ("zb-1p", "zb-2p")
DEFAULT_PROFILE_ITERS = 2
# W keeps a micro-batch's activations entirely: the most memory W can hold. Unless profiled or
# given, the scheduler assumes it, so its memory limit holds in the runtime's own accounting
# whatever the model's real ratio (memory after any prefix of ops grows with M_W / M_B, since
# every stage has run at least as many B passes as W passes). The reference's 1/2 can
# underestimate badly: the tiny GPTs of the tests keep 0.77-0.98 of M_B for W (no dropout).
DEFAULT_M_W = 1.0
_FLAGS = {"zb_profile_iters": "--zb-profile-iters", "zb_costs": "--zb-costs", "zb_memory_limit": "--zb-memory-limit"}


def add_zero_bubble_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("zero bubble (zb-1p / zb-2p)")
    g.add_argument("--zb-profile-iters", type=int, default=None, metavar="K",
                   help=f"zb-1p/zb-2p: run ZB-H1 for the first K iterations while timing F, B and W, then "
                        f"the schedule searched with those costs (default {DEFAULT_PROFILE_ITERS}; 0: use "
                        f"--zb-costs or the placeholder costs T_F = T_B = T_W = 1, T_comm = 0, M_W/M_B = 1)")
    g.add_argument("--zb-costs", default=None, metavar="T_F,T_B,T_W,T_COMM[,M_W/M_B] | PROFILE.json",
                   help="zb-1p/zb-2p: fixed costs (ms; any unit works if it is the same for all four) and "
                        f"optionally the activation memory W keeps relative to a micro-batch's (default {DEFAULT_M_W:g}), "
                        "or a JSON profile with per-stage costs (as logged after profiling); skips profiling, "
                        "so emulator and distributed runs use the same order")
    g.add_argument("--zb-memory-limit", type=float, default=None, metavar="X",
                   help="zb-1p/zb-2p: activation-memory limit of the schedule search, in units of one "
                        "micro-batch's activations on a stage (M_B); default N (zb-1p) or 2N (zb-2p)")


def parse_costs(text: str, num_stages: int):
    """``--zb-costs``: ``T_F,T_B,T_W,T_COMM[,M_W/M_B]`` or a JSON profile file: the format of
    :func:`megatron.pipeline.simulator.costs_from_profile` (per-stage costs under ``"stages"``),
    or the object the trainer logs after profiling (``zero-bubble-schedule {...}``, per-stage
    costs under ``"costs"``). Returns one :class:`OpCosts` per stage; ValueError (one line)."""
    from megatron.pipeline.simulator import OpCosts, costs_from_profile, load_profile

    if "," not in text and (text.endswith(".json") or os.path.isfile(text)):
        try:
            profile = load_profile(text)
            if isinstance(profile.get("costs"), list):  # the trainer's logged zero-bubble-schedule object
                profile = {"stages": profile["costs"]}
            return costs_from_profile({"m_w": DEFAULT_M_W, **profile}, num_stages)
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
    m_w = values[4] if len(values) == 5 else DEFAULT_M_W
    return (OpCosts(values[0], values[1], values[2], t_comm=values[3], m_w=m_w),) * num_stages


def validate_zero_bubble_args(args: argparse.Namespace) -> None:
    """Check the zb flags (one-line :class:`ArgumentError`); resolve ``args.zb_profile_iters``."""
    from megatron.trainer.config.errors import ArgumentError

    auto = args.pipeline_schedule in ZB_AUTO_SCHEDULES
    for attr, flag in _FLAGS.items():
        if getattr(args, attr, None) is not None and not auto:
            raise ArgumentError(
                f"{flag} is only valid with --pipeline-schedule zb-1p or zb-2p (got {args.pipeline_schedule})")
    if not auto:
        args.zb_profile_iters = 0
        return
    iters = getattr(args, "zb_profile_iters", None)
    if iters is not None and iters < 0:
        raise ArgumentError(f"--zb-profile-iters must be >= 0, got {iters}")
    args.zb_cost_values = None
    if getattr(args, "zb_costs", None) is not None:
        if iters:
            raise ArgumentError(f"--zb-costs fixes the costs; it excludes profiling (--zb-profile-iters {iters}); drop one")
        try:
            args.zb_cost_values = parse_costs(args.zb_costs, args.pipeline_model_parallel_size)
        except ValueError as exc:
            raise ArgumentError(str(exc)) from None
        iters = 0
    args.zb_profile_iters = DEFAULT_PROFILE_ITERS if iters is None else iters
    limit = getattr(args, "zb_memory_limit", None)
    if limit is not None and not (math.isfinite(limit) and limit >= 1):
        raise ArgumentError(
            f"--zb-memory-limit must be at least 1 (one micro-batch's activations, M_B), got {limit}")
    # Build the schedule now (with the fixed or placeholder costs): an infeasible memory limit
    # fails here, before any process starts, not at iteration K.
    from megatron.pipeline.schedules import ScheduleConfigError, build_schedule
    from megatron.trainer.config.run_config import schedule_config

    try:
        build_schedule(args.pipeline_schedule, schedule_config(args))
    except ScheduleConfigError as exc:
        raise ArgumentError(f"--pipeline-schedule: {exc}") from None


def zero_bubble_options(args: argparse.Namespace) -> dict[str, Any]:
    """``ScheduleConfig.options`` of zb-1p / zb-2p: costs, memory limit, profiling iterations."""
    if getattr(args, "pipeline_schedule", None) not in ZB_AUTO_SCHEDULES:
        return {}
    from megatron.pipeline.simulator import OpCosts

    options: dict[str, Any] = {}
    costs = getattr(args, "zb_cost_values", None)
    options["costs"] = costs if costs is not None else OpCosts(m_w=DEFAULT_M_W)
    if getattr(args, "zb_memory_limit", None) is not None:
        options["memory_limit"] = float(args.zb_memory_limit)
    iters = getattr(args, "zb_profile_iters", None)
    if iters:
        options["profile_iters"] = int(iters)
    return options
