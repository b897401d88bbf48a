"""Megatron-LM flags beyond the core set, so Megatron-LM's own launch scripts run as written.

Each flag here either works or is refused with one line before any rank starts:

* model options that map onto megatron-core's ``TransformerConfig`` / ``GPTModel``
  (``--swiglu``, ``--disable-bias-linear``, ``--norm-epsilon``, ``--kv-channels``,
  ``--rotary-base``, ``--rotary-percent``, ``--group-query-attention``, ``--attention-backend``,
  ``--untie-embeddings-and-output-weights``, see :mod:`.tied_args`);
* sample-based training lengths (``--train-samples``, ``--lr-warmup-samples``,
  ``--lr-decay-samples``, ``--lr-warmup-fraction``), the WSD learning-rate schedule and
  ``--rampup-batch-size`` (the plan comes from megatron-core's micro-batch calculator, see
  :mod:`megatron.trainer.config.rampup_args`);
* checkpoint loading options (``--no-load-optim``, ``--finetune``);
* logging options (``--log-throughput``, ``--log-params-norm``, ``--wandb-*``).

``--train-samples`` gives Megatron-LM's iteration count (partial last batch dropped). Our
learning rate is a function of a stage's update count (asynchronous stages step on their own
clocks), so the learning-rate sample counts are converted to iterations: the first iteration
after which at least that many samples were consumed (exact when they are multiples of a
constant global batch).

:data:`REFUSED_FLAGS` lists Megatron-LM flags accepted by the parser only to be refused with
one line (a clearer error than argparse's "unrecognized arguments").
"""
from __future__ import annotations

import argparse
import importlib.util

from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.values import FlagValue
from megatron.trainer.config.job_config import JobConfig, flag_values
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.config.batch_plan import BatchPlan
from megatron.trainer.config.rampup_args import batch_plan, check_rampup_flags
from megatron.trainer.config.choices import WSD_DECAY_STYLES

DEFAULT_TRAIN_ITERS = 20

ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
# Backends our local spec honours: its SDPA core attention is the unfused/local maths and
# lets PyTorch pick a kernel under "auto". Flash and fused are Transformer Engine's.
LOCAL_SPEC_BACKENDS = ("auto", "unfused", "local")

# dest -> the one line a user gets when setting it.
REFUSED_FLAGS: dict[str, str] = {
    "distribute_saved_activations": "--distribute-saved-activations is not supported: the recompute here keeps "
                                    "each region's input whole on every tensor-parallel rank (no split over the "
                                    "TP group)",
}


# dest -> why setting it changes nothing: flags that ask for what every run here does anyway.
DEFAULT_BEHAVIOUR_FLAGS: dict[str, str] = {}


# Model flags of this module a checkpoint must have been saved with (checked on --load).
COMPAT_SIGNATURE_FLAGS = ("swiglu", "add_bias_linear", "kv_channels", "norm_epsilon", "rotary_base", "rotary_percent",
                          "untie_embeddings_and_output_weights")


def add_megatron_compat_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (Megatron-LM options)")
    g.add_argument("--swiglu", action="store_true",
                   help="SwiGLU MLP (gated SiLU); default --ffn-hidden-size becomes int(8h/3 / 64) * 64")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                   help="no biases in the linear layers")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="separate output-layer weights (default: tied, as in Megatron-LM; asynchronous "
                        "schedules are always untied)")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="epsilon of LayerNorm / RMSNorm")
    g.add_argument("--kv-channels", type=int, default=None, help="head dimension (default: hidden / heads)")
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE base period")
    g.add_argument("--rotary-percent", type=float, default=1.0, help="share of head dimensions RoPE rotates")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups (Megatron's default: 1)")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="auto/unfused/local: our SDPA attention on the local spec; flash/fused: Transformer Engine")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with --tensor-model-parallel-size > 1: norms and dropouts on s / T positions per TP rank "
                        "(reduce-scatter / all-gather around the TP linears; gloo and NCCL)")
    g = p.add_argument_group("training length in samples, warm-up, WSD, batch-size rampup")
    g.add_argument("--train-samples", type=int, default=None,
                   help="train for this many samples (instead of --train-iters)")
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of the decay length (instead of --lr-warmup-iters)")
    g.add_argument("--lr-wsd-decay-style", choices=WSD_DECAY_STYLES, default="exponential",
                   help="anneal shape of --lr-decay-style WSD")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None, help="WSD anneal length in iterations")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None, help="WSD anneal length in samples")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="grow the global batch from START by INCREMENT over SAMPLES samples")
    g = p.add_argument_group("checkpoint loading")
    g.add_argument("--no-load-optim", action="store_true",
                   help="with --load: weights, RNG and iteration only; fresh optimizer and LR schedule")
    g.add_argument("--finetune", action="store_true",
                   help="with --load: weights only; iteration 0, fresh optimizer, LR schedule and RNG")
    g = p.add_argument_group("logging (Megatron-LM options)")
    g.add_argument("--log-throughput", action="store_true", help="model TFLOP/s per GPU in the log line")
    g.add_argument("--log-params-norm", action="store_true", help="L2 norm of all parameters in the log line")
    g.add_argument("--wandb-project", default=None, help="log to Weights & Biases (needs the wandb package)")
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--wandb-save-dir", default=None)
    g = p.add_argument_group("Megatron-LM flags refused here")
    for dest in REFUSED_FLAGS:
        g.add_argument("--" + dest.replace("_", "-"), action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(train_iters=None)  # so --train-samples can be told apart from the default


def finalize_megatron_compat_args(args: argparse.Namespace) -> dict[str, FlagValue]:
    """Megatron-LM's defaults of these flags: iteration counts from sample counts and fractions
    (after the global batch is known), the SwiGLU FFN size, one query group, ``adam`` as AdamW.

    Each value is already in its domain (``flag_checks.DOMAINS``); these are the cross-flag rules."""
    if args.train_iters is not None and args.train_samples is not None:
        raise ConfigError("--train-iters and --train-samples are mutually exclusive")
    out: dict[str, FlagValue] = {}
    if args.swiglu and args.ffn_hidden_size is None:
        out["ffn_hidden_size"] = int((4 * args.hidden_size * 2 / 3) / 64) * 64
    if args.group_query_attention and args.num_query_groups is None:
        out["num_query_groups"] = 1
    if args.optimizer == "adam":  # Megatron-LM's adam is AdamW: decoupled weight decay
        out["optimizer"] = "adamw"
    batches = batch_plan(args)  # global batch per iteration (constant without rampup)
    train_iters = args.train_iters
    if train_iters is None:
        train_iters = DEFAULT_TRAIN_ITERS if args.train_samples is None else batches.iterations_in(args.train_samples)
    decay_iters = _samples_to_iters(args.lr_decay_iters, batches, args.lr_decay_samples, "lr_decay_iters")
    decay_iters = train_iters if decay_iters is None else decay_iters
    warmup_iters = args.lr_warmup_iters
    if args.lr_warmup_samples:
        if warmup_iters:
            raise ConfigError("--lr-warmup-iters and --lr-warmup-samples are mutually exclusive")
        warmup_iters = batches.iterations_for(args.lr_warmup_samples)
    if args.lr_warmup_fraction is not None:
        if warmup_iters:
            raise ConfigError("can only specify one of --lr-warmup-fraction and --lr-warmup-iters/-samples")
        warmup_iters = int(args.lr_warmup_fraction * decay_iters)
    wsd_iters = _samples_to_iters(args.lr_wsd_decay_iters, batches, args.lr_wsd_decay_samples, "lr_wsd_decay_iters")
    return {**out, "train_iters": train_iters, "lr_decay_iters": decay_iters, "lr_warmup_iters": warmup_iters,
            "lr_wsd_decay_iters": wsd_iters}


def _samples_to_iters(given: int | None, batches: BatchPlan, samples: int | None, iters: str) -> int | None:
    """``--X-iters`` from ``--X-samples`` (its value ``samples``; one of them at most; ``given``:
    the ``--X-iters`` value)."""
    if samples is None:
        return given
    if given is not None:
        flag = "--" + iters.replace("_", "-")
        raise ConfigError(f"{flag.replace('-iters', '-samples')} and {flag} are mutually exclusive")
    return batches.iterations_for(samples)


def check_megatron_compat_flags(args: argparse.Namespace) -> None:
    """Raise :class:`ConfigError` (one line) for a flag this run cannot honour."""
    for dest, message in REFUSED_FLAGS.items():
        if getattr(args, dest):
            raise ConfigError(message)
    if args.optimizer == "sgd":
        raise ConfigError("--optimizer sgd is not implemented (adam/adamw, basis-rotation, muon and delay-nesterov are)")
    _check_wsd_flags(args)
    _check_model_options(args)
    _check_transformer_impl(args)
    _check_data_flags(args)
    _check_loading(args)
    if args.wandb_project is not None and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--wandb-project needs the wandb package: pip install -e \".[wandb]\" (or pip install wandb)")
    if args.wandb_project is None and (args.wandb_exp_name or args.wandb_save_dir):
        raise ConfigError("--wandb-exp-name/--wandb-save-dir need --wandb-project")
    check_rampup_flags(args)


def _check_wsd_flags(args: argparse.Namespace) -> None:
    if args.lr_decay_style != "WSD":
        if args.lr_wsd_decay_iters is not None:
            raise ConfigError("--lr-wsd-decay-iters/-samples need --lr-decay-style WSD")
        return
    if args.lr_wsd_decay_iters is None:
        raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples")
    room = args.lr_decay_iters - args.lr_warmup_iters
    if not 1 <= args.lr_wsd_decay_iters <= room:
        raise ConfigError(f"--lr-wsd-decay-iters {args.lr_wsd_decay_iters} must be in [1, {room}] "
                          f"(decay iterations minus warm-up)")


def _check_model_options(args: argparse.Namespace) -> None:
    """Model options megatron-core's BERT lacks, and attention backends our spec cannot run."""
    bert = hasattr(args, "bert_binary_head")
    if bert and args.position_embedding_type == "none":
        raise ConfigError("--position-embedding-type none: megatron-core's BertModel supports "
                          "learned_absolute and rope only")
    if bert and args.rotary_base != 10000:
        raise ConfigError("--rotary-base: megatron-core's BertModel has a fixed RoPE base of 10000")
    if args.position_embedding_type != "rope" and (args.rotary_base != 10000 or args.rotary_percent != 1.0):
        raise ConfigError("--rotary-base/--rotary-percent need --position-embedding-type rope")
    kv = args.kv_channels or args.hidden_size // args.num_attention_heads
    if args.position_embedding_type == "rope" and int(kv * args.rotary_percent) % 2:
        raise ConfigError(f"--rotary-percent {args.rotary_percent} of head dimension {kv} must be even")
    if args.attention_backend not in LOCAL_SPEC_BACKENDS and args.transformer_impl != "transformer_engine":
        raise ConfigError(f"--attention-backend {args.attention_backend} needs --transformer-impl "
                          f"transformer_engine (the local spec runs auto, unfused or local)")


def _check_transformer_impl(args: argparse.Namespace) -> None:
    """Transformer Engine needs its package and a GPU; say so before any rank builds a layer."""
    if args.transformer_impl != "transformer_engine":
        return
    if args.device == "cpu":
        raise ConfigError("--transformer-impl transformer_engine needs a GPU; use --transformer-impl "
                          "local on --device cpu")
    if importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError("--transformer-impl transformer_engine needs the transformer_engine package "
                          "(pip install transformer_engine[pytorch]); or use --transformer-impl local")
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("--transformer-impl transformer_engine needs a GPU and none is available")


def _check_data_flags(args: argparse.Namespace) -> None:
    """Document-boundary flags need documents: mock data has no end-of-document tokens."""
    used = [f"--{d.replace('_', '-')}" for d in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss")
            if getattr(args, d)]
    if not used:
        return
    if hasattr(args, "bert_binary_head"):
        raise ConfigError(f"{' '.join(used)}: GPT-only flags (BERT samples are sentence pairs)")
    if args.data_path is None:
        raise ConfigError(f"{' '.join(used)} need --data-path: mock data has no end-of-document tokens")


def _check_loading(args: argparse.Namespace) -> None:
    if (args.no_load_optim or args.finetune) and args.load is None:
        raise ConfigError("--no-load-optim/--finetune need --load DIR")


def compat_model_kwargs(config: RunPlan) -> dict[str, object]:
    """The :class:`~megatron.trainer.models.stage.TransformerArgs` fields of these flags."""
    model = config.model
    return dict(swiglu=model.swiglu, add_bias_linear=model.add_bias_linear, norm_epsilon=model.norm_epsilon,
                kv_channels=model.kv_channels, rotary_base=model.rotary_base, rotary_percent=model.rotary_percent,
                attention_backend=model.attention_backend, sequence_parallel=config.parallel.sequence_parallel,
                tie_embeddings=config.embeddings.tied)


def flops_per_iteration(config: JobConfig, global_batch: int) -> float:
    """Model FLOPs of one training iteration (forward + backward = 3 x forward).

    Forward per token: 2 x the multiply-adds of the layers' linears (QKV with GQA, output
    projection, MLP with SwiGLU's gate), the attention scores and weighted sum
    (2 x 2 x seq x kv-channels x heads per layer), and the output layer (2 x hidden x vocab).
    """
    h, layers, s = config.model.hidden_size, config.model.num_layers, config.model.seq_length
    heads = config.model.num_attention_heads
    kv = config.model.kv_channels or h // heads
    groups = config.model.num_query_groups or heads
    ffn = config.model.ffn_hidden_size or 4 * h
    qkv = h * kv * (heads + 2 * groups)
    proj = heads * kv * h
    mlp = h * ffn * (3 if config.model.swiglu else 2)
    attention = 2 * s * kv * heads
    per_token = 2 * (layers * (qkv + proj + mlp + attention) + h * config.vocab.size)
    return 3.0 * per_token * s * global_batch


def wandb_run(config: JobConfig):  # pragma: no cover - wandb is not installed in CI
    """A Weights & Biases run for ``--wandb-project`` (None without it); rank 0 only."""
    log = config.logging
    if log.wandb_project is None:
        return None
    import wandb

    return wandb.init(project=log.wandb_project, name=log.wandb_exp_name, dir=log.wandb_save_dir,
                      config={k: v for k, v in flag_values(config).items() if isinstance(v, (int, float, str, bool))})

