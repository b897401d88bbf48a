"""Flags of ``--optimizer muon`` (megatron.trainer.optim.muon), with their checks.

The names are megatron-core's (``OptimizerConfig.muon_*``, Megatron-LM's ``--muon-*``); its
``--muon-tp-mode`` and ``--muon-fp32-matmul-prec`` are not offered (tensor parallelism is refused
with Muon, and the Newton–Schulz dtype is ``--muon-ns-dtype``). Kept apart from the optimizer
module so that parsing flags does not depend on its code, like the other ``*_args`` modules.
"""
from __future__ import annotations

import argparse

from megatron.trainer.config.errors import ConfigError

SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
NS_DTYPES = ("float32", "bfloat16")
#: (flag, dest, default): a flag moved off its default without --optimizer muon is refused
MUON_DEFAULTS = (("--muon-momentum", "muon_momentum", 0.95), ("--muon-use-nesterov", "muon_use_nesterov", False),
                 ("--muon-num-ns-steps", "muon_num_ns_steps", 5), ("--muon-scale-mode", "muon_scale_mode", "spectral"),
                 ("--muon-extra-scale-factor", "muon_extra_scale_factor", 1.0),
                 ("--muon-no-split-qkv", "muon_split_qkv", True), ("--muon-ns-dtype", "muon_ns_dtype", "float32"))


def add_muon_args(group: argparse._ArgumentGroup) -> None:
    """Add the Muon flags to the parser's optimizer group."""
    defaults = {dest: default for _, dest, default in MUON_DEFAULTS}
    group.add_argument("--muon-momentum", type=float, default=defaults["muon_momentum"],
                       help="muon: momentum of the buffer B")
    group.add_argument("--muon-use-nesterov", action="store_true",
                       help="muon: orthogonalise lerp(g, B, momentum) instead of B")
    group.add_argument("--muon-num-ns-steps", type=int, default=defaults["muon_num_ns_steps"],
                       help="muon: Newton-Schulz iterations")
    group.add_argument("--muon-scale-mode", choices=SCALE_MODES, default=defaults["muon_scale_mode"],
                       help="muon: update scale for an m x n weight: spectral sqrt(max(m,n)), unit_rms_norm "
                            "sqrt(m/n), shape_scaling sqrt(max(1,m/n))")
    group.add_argument("--muon-extra-scale-factor", type=float, default=defaults["muon_extra_scale_factor"],
                       help="muon: one more factor on the update (0.2 with spectral: Moonshot's AdamW-matched RMS)")
    group.add_argument("--muon-no-split-qkv", dest="muon_split_qkv", action="store_false",
                       help="muon: orthogonalise the fused QKV weight whole instead of per Q, K, V block")
    group.add_argument("--muon-ns-dtype", choices=NS_DTYPES, default=defaults["muon_ns_dtype"],
                       help="muon: dtype of the Newton-Schulz iteration (bfloat16: torch.optim.Muon's)")


def check_muon_flags(args: argparse.Namespace) -> None:
    """One-line :class:`ConfigError` for a bad combination (before any rank starts); the numeric
    flags' ranges are :data:`~megatron.trainer.config.flag_checks.DOMAINS`'."""
    if args.optimizer != "muon":
        changed = [flag for flag, dest, default in MUON_DEFAULTS if getattr(args, dest) != default]
        if changed:
            raise ConfigError(f"{changed[0]} needs --optimizer muon")
        return
    if args.use_distributed_optimizer:
        raise ConfigError("--use-distributed-optimizer with --optimizer muon is not supported: Newton-Schulz "
                          "orthogonalises whole matrices, its update does not shard into element ranges")
    if args.tensor_model_parallel_size > 1:
        raise ConfigError(f"--optimizer muon with --tensor-model-parallel-size {args.tensor_model_parallel_size}: "
                          "Newton-Schulz of a weight's shard is not that of the full weight (use --optimizer adamw)")
    if args.enable_optimizer_post_validation and args.muon_momentum == 0.0 and not args.optimizer_post_validation_exact:
        raise ConfigError("--optimizer muon with --muon-momentum 0 cannot roll back in place under "
                          "--enable-optimizer-post-validation (add --optimizer-post-validation-exact)")
