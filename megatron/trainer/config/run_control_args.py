"""Flags for evaluation, checkpoints, early exit and TensorBoard (Megatron-LM's names).

Evaluation runs only when ``--eval-interval`` is given: every that many iterations on the
validation split, once more at the end, then on the test split (if it has data). Each
evaluation reads the same first ``--eval-iters`` global batches of its split, so curves
are comparable across schedules, depths and resumed runs.
"""
from __future__ import annotations

import argparse
import importlib.util

from megatron.trainer.config.errors import ConfigError


def add_run_control_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="evaluate on the validation split every N iterations and at the end (default: never)")
    g.add_argument("--eval-iters", type=int, default=10,
                   help="global batches per evaluation (forward only through the pipeline)")
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, metavar="DIR", help="write checkpoints to DIR")
    g.add_argument("--save-interval", type=int, default=None,
                   help="checkpoint every N iterations (with --save; the run's end is always saved)")
    g.add_argument("--load", default=None, metavar="DIR",
                   help="resume from DIR's latest checkpoint (fresh if DIR holds none yet; a missing DIR is an error unless it is also --save)")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop after iteration N is a multiple of this (saving first with --save)")
    g = p.add_argument_group("tensorboard")
    g.add_argument("--tensorboard-dir", default=None, metavar="DIR",
                   help="write TensorBoard scalars (loss, lr, tokens/s, drift, memory, evaluation) to DIR")


def check_run_control_flags(args: argparse.Namespace) -> None:
    for flag in ("eval_interval", "save_interval", "exit_interval"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.eval_interval is not None and args.eval_iters < 1:
        raise ConfigError("--eval-interval needs --eval-iters >= 1")
    if args.save_interval is not None and args.save is None:
        raise ConfigError("--save-interval needs --save DIR")
    if args.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard-dir needs the tensorboard package: pip install tensorboard")
