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
from megatron.trainer.config.job_config import JobConfig, build_job_config
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.optim.fused_adamw import fused_adamw_available_in_torch
from megatron.trainer.plan.build import build_run_plan
from megatron.trainer.plan.data import check_data
from megatron.trainer.plan.partition import resolve_partition


def resolve_adam_kernel(args: argparse.Namespace) -> None:
    """``--adam-kernel auto`` becomes what runs; ``fused`` where it cannot run is refused."""
    plain_adam = args.optimizer in ("adam", "adamw")
    if args.adam_kernel == "auto":
        args.adam_kernel = "fused" if plain_adam and fused_adamw_available_in_torch() else "single-tensor"
    elif args.adam_kernel == "fused" and not plain_adam:
        raise ConfigError(f"--adam-kernel fused runs plain AdamW; --optimizer {args.optimizer} has its own update")
    elif args.adam_kernel == "fused" and not fused_adamw_available_in_torch():
        raise ConfigError("--adam-kernel fused: this torch has no torch._fused_adamw_ (use single-tensor)")


def check_paths(args: argparse.Namespace) -> None:
    """``--save`` writable with room for a checkpoint, ``--load`` a directory."""
    try:
        check_checkpoint_paths(build_job_config(args))
    except CheckpointPathError as exc:
        raise ConfigError(str(exc)) from None


def check_args(args: argparse.Namespace) -> None:
    """Derive and check a parsed namespace in place (raise :class:`ConfigError`, one line)."""
    finalize_args(args)
    check_model_flags(args)
    resolve_adam_kernel(args)
    check_data(args)  # the padded vocabulary, which the combinations' checks read
    check_flags(args)
    resolve_partition(args)  # --pipeline-partition: the layer split
    check_paths(args)


def parse_args(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse, derive and check; exits with status 2 and one line on a bad combination."""
    parser = parser or build_parser()
    return checked_args(parser, parse_command_line(parser, argv))


def checked_args(parser: argparse.ArgumentParser, command: CommandLine) -> argparse.Namespace:
    """Derive and check the parsed ``command.args`` in place, then write them if ``--dump-config``
    asked (and exit); exits with status 2 and one line on a bad combination. (The user's flags as
    parsed, before this, are what ``auto`` derives its other layouts from:
    :mod:`megatron.trainer.loop.auto.candidates`.)"""
    args = command.args
    try:
        check_flag_values(parser, args)  # every numeric flag in its domain, list flags parsed strictly
        check_args(args)
    except ConfigError as exc:
        parser.exit(2, f"error: {exc}\n")
    command.dump_if_asked(parser)  # --dump-config PATH: write the flags as asked, exit 0
    return args


def parse_job_config(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> JobConfig:
    """:func:`parse_args`, then the typed config of what was asked."""
    return build_job_config(parse_args(argv, parser))


def parse_run_plan(argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None) -> RunPlan:
    """:func:`parse_args`, then the run plan (tools and tests that drive a run)."""
    return build_run_plan(parse_args(argv, parser))
