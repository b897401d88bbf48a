"""Megatron-LM's data-parallel flags: ``--overlap-grad-reduce``, ``--ddp-bucket-size``,
``--use-distributed-optimizer``, ``--overlap-param-gather``.

Why a module of its own: the flags configure the runtime's data-parallel transport
(:mod:`megatron.pipeline.runtime.grad_buckets`), not the model or the schedule. Bucket sizes
are elements, as in Megatron-LM. With one data-parallel replica (and so always on the emulator)
there is nothing to reduce: the flag is a documented no-op there, not a refusal, so one flag set
runs at any DP. ``--ddp-bucket-size`` without ``--overlap-grad-reduce`` is refused: the
non-overlapped reduction is one all-reduce at the step and has no buckets to size.

``--use-distributed-optimizer`` shards each stage's optimizer state over its data-parallel
replicas (:mod:`megatron.pipeline.runtime.distributed_optimizer`); like the overlap it is a
no-op at one replica. ``--overlap-param-gather`` overlaps that optimizer's parameter all-gather
and means nothing without it. Basis rotation is refused: it rotates whole matrices, so its
state does not split into element ranges.
"""
from __future__ import annotations

import argparse

from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.values import FlagValue
from megatron.trainer.config.job_config import JobConfig

#: Megatron-LM's DDP default bucket size in elements (its max(40M, 1M x DP) for DP <= 40).
DEFAULT_BUCKET_SIZE = 40_000_000


def add_ddp_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data-parallel gradient reduction (Megatron-LM)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="all-reduce gradients in buckets, each launched as soon as the window's last "
                        "backward (or W) has finished it, so the reduction overlaps the backward; "
                        "a no-op with one data-parallel replica (and on the emulator)")
    g.add_argument("--ddp-bucket-size", type=int, default=None, metavar="ELEMENTS",
                   help=f"with --overlap-grad-reduce: elements per bucket (default {DEFAULT_BUCKET_SIZE:,})")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="ZeRO-1: shard each stage's AdamW state and fp32 masters over its data-parallel "
                        "replicas (reduce-scatter gradients, step the shard, all-gather parameters); "
                        "a no-op with one data-parallel replica (and on the emulator)")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer: all-gather the parameters asynchronously after "
                        "the step, waited for before the stage next reads its weights")


def check_ddp_flags(args: argparse.Namespace) -> dict[str, FlagValue]:
    """One-line :class:`ConfigError` for a combination that cannot act; the default bucket size
    it fills (the domain, >= 1, is :data:`~megatron.trainer.config.flag_checks.DOMAINS`')."""
    if args.ddp_bucket_size is not None and not args.overlap_grad_reduce:
        raise ConfigError("--ddp-bucket-size sizes the buckets of --overlap-grad-reduce; without it the "
                          "gradients are all-reduced at once at the step")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ConfigError("--overlap-param-gather needs the distributed optimizer (--use-distributed-optimizer): "
                          "it overlaps that optimizer's parameter all-gather")
    if args.use_distributed_optimizer and args.optimizer == "basis-rotation":
        raise ConfigError("--use-distributed-optimizer with --optimizer basis-rotation is not supported: basis "
                          "rotation rotates whole matrices, its state does not shard into element ranges")
    if args.overlap_grad_reduce and args.ddp_bucket_size is None:
        return {"ddp_bucket_size": DEFAULT_BUCKET_SIZE}
    return {}


def overlap_bucket_size(config: JobConfig) -> int | None:
    """What a stage's gradient sync gets: the bucket size when overlapping, else None."""
    return config.parallel.ddp_bucket_size if config.parallel.overlap_grad_reduce else None
