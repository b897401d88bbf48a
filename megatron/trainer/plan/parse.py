"""From argv to the checked job config: the config's flags and checks, and what only the floors
above the config can decide.

The parser, its defaults and the checks that read nothing but the flags live on the config
floor (:mod:`megatron.trainer.config.arguments`). Some checks need more: the tokenizer's
vocabulary (padded, so tensor-parallel divisibility can be checked), whether this torch has the
fused AdamW kernel, the cost model's balanced layer split, and whether ``--save`` and ``--load``
are usable directories. They run here, in the order a reader of Megatron-LM's
``validate_args`` expects: sizes, then data, then combinations, then the split and the paths.
Every failure is one ``error:`` line and exit status 2, before any process group exists.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

from megatron.trainer.checkpointing.paths import CheckpointPathError, check_checkpoint_paths
from megatron.trainer.config.arguments import build_parser, check_flags, check_model_flags, finalize_args
from megatron.trainer.config.config_file import CommandLine, parse_command_line
from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.flag_checks import check_flag_values
from megatron.trainer.config.job_config import JobConfig
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.config.values import with_values
from megatron.trainer.optim.fused_adamw import fused_adamw_available_in_torch
from megatron.trainer.plan.build import build_run_plan
from megatron.trainer.plan.data import check_data
from megatron.trainer.plan.partition import resolve_partition


def resolve_adam_kernel(args: argparse.Namespace) -> str:
    """What ``--adam-kernel auto`` runs here; ``fused`` where it cannot run is refused."""
    plain_adam = args.optimizer in ("adam", "adamw")
    if args.adam_kernel == "auto":
        return "fused" if plain_adam and fused_adamw_available_in_torch() else "single-tensor"
    if args.adam_kernel == "fused" and not plain_adam:
        raise ConfigError(f"--adam-kernel fused runs plain AdamW; --optimizer {args.optimizer} has its own update")
    if args.adam_kernel == "fused" and not fused_adamw_available_in_torch():
        raise ConfigError("--adam-kernel fused: this torch has no torch._fused_adamw_ (use single-tensor)")
    return args.adam_kernel


def check_paths(plan: RunPlan) -> None:
    """``--save`` writable with room for a checkpoint, ``--load`` a directory."""
    try:
        check_checkpoint_paths(plan)
    except CheckpointPathError as exc:
        raise ConfigError(str(exc)) from None


def checked_flags(args: argparse.Namespace) -> tuple[argparse.Namespace, RunPlan]:
    """The parsed flags ``args`` with Megatron-LM's defaults filled in (a new namespace: ``args``
    stays as the user gave it), checked, and the run planned from them (raise
    :class:`ConfigError`, one line)."""
    args = finalize_args(args)
    check_model_flags(args)
    args = with_values(args, adam_kernel=resolve_adam_kernel(args))
    check_data(args)  # data files, tokenizer files
    args = check_flags(args)
    layers = resolve_partition(args)  # --pipeline-partition: the layer split
    plan = build_run_plan(args, layers)
    check_paths(plan)  # the checkpoint's size: the planned model (tied or not)
    return args, plan


def check_args(args: argparse.Namespace) -> RunPlan:
    """Check the parsed flags and plan the run (:func:`checked_flags`)."""
    return checked_flags(args)[1]


def parse_args(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse and check; the flags with Megatron-LM's defaults filled in. Exits with status 2
    and one line on a bad combination."""
    parser = parser or build_parser()
    return _checked(parser, parse_command_line(parser, argv))[0]


def checked_plan(parser: argparse.ArgumentParser, command: CommandLine) -> RunPlan:
    """Check the parsed ``command.args`` and plan the run, then write the flags if
    ``--dump-config`` asked (and exit); exits with status 2 and one line on a bad combination.
    (The user's flags as parsed are what ``auto`` derives its other layouts from:
    :mod:`megatron.trainer.loop.auto.candidates`.)"""
    return _checked(parser, command)[1]


def _checked(parser: argparse.ArgumentParser, command: CommandLine) -> tuple[argparse.Namespace, RunPlan]:
    try:
        check_flag_values(parser, command.args)  # every numeric flag in its domain, list flags parsed strictly
        checked = checked_flags(command.args)
    except ConfigError as exc:
        parser.exit(2, f"error: {exc}\n")
    command.dump_if_asked(parser)  # --dump-config PATH: write the flags as asked, exit 0
    return checked


def parse_job_config(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> JobConfig:
    """:func:`parse_args`, then the typed config of what was asked."""
    return parse_run_plan(argv, parser).config


def parse_run_plan(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> RunPlan:
    """Parse, check and plan (tools and tests that drive a run); exits with status 2 and one
    line on a bad combination."""
    parser = parser or build_parser()
    return checked_plan(parser, parse_command_line(parser, argv))
