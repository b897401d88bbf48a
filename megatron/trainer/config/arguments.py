"""Megatron-LM-style command-line flags and their checks.

Every check runs before any process group or worker process exists, and every failure is
one line naming the flag, so a bad launch on a 64-GPU job fails in a second, not after
the rendezvous.
"""
from __future__ import annotations

import argparse

from megatron.pipeline.schedules import DEFAULT_SCHEDULE, SCHEDULES, ScheduleConfigError
from megatron.pipeline.planner.auto_schedule import register_auto_selectors
from megatron.trainer.config.basis_rotation_args import add_basis_rotation_args, check_basis_rotation_flags
from megatron.trainer.config.muon_args import add_muon_args, check_muon_flags
from megatron.trainer.config.delay_nesterov_args import add_delay_nesterov_args, check_delay_nesterov_flags
from megatron.trainer.config.schedule_args import add_schedule_args, check_schedule_flags
from megatron.trainer.config.run_control_args import add_run_control_args, check_run_control_flags
from megatron.trainer.config.insight_args import add_insight_args
from megatron.trainer.config.mixed_precision_args import add_mixed_precision_args, check_mixed_precision_flags
from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.values import FlagValue, with_values
from megatron.trainer.environment import world_size_from_env
from megatron.trainer.config.choices import (
    BIND_CORES_CHOICES, DECAY_STYLES, HOST_MALLOC_CHOICES, OPTIMIZER_NAMES, TOKENIZER_TYPES)
from megatron.trainer.config.job_config import build_job_config, microbatches, model_chunks
from megatron.trainer.config.run_config import RunConfig
from megatron.trainer.config.flag_checks import OneLineParser
from megatron.trainer.config.exit_args import add_exit_args, check_exit_flags
from megatron.trainer.config.restart_args import add_restart_args, check_restart_flags
from megatron.trainer.config.recompute_args import add_recompute_args, check_recompute_flags
from megatron.trainer.config.ddp_args import add_ddp_args, check_ddp_flags
from megatron.trainer.config.tensor_parallel_args import check_tensor_parallel_flags
from megatron.trainer.config.megatron_split_args import add_megatron_split_args, resolve_megatron_split
from megatron.trainer.config.config_file import add_config_file_args
from megatron.trainer.config.megatron_compat_args import (
    add_megatron_compat_args, finalize_megatron_compat_args, check_megatron_compat_flags)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=256,
                   help="vocabulary of the mock data and of NullTokenizer; with any other --tokenizer-type "
                        "the tokenizer's, padded to --make-vocab-size-divisible-by")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad a tokenizer's vocabulary to a multiple of this (x tensor-parallel size)")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"], default="learned_absolute")
    g.add_argument("--bf16", action="store_true", help="bf16 model and activations (fp32 master weights)")
    g.add_argument("--transformer-impl", choices=["auto", "local", "transformer_engine"], default="auto",
                   help="auto: Transformer Engine layer spec on GPU when installed, else the local spec with SDPA attention")


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro-batch x data-parallel size")
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--seed", type=int, default=1234)
    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=[*OPTIMIZER_NAMES, "sgd"], default="adamw",  # sgd: refused with one line
                   help="adam: Megatron-LM's name for AdamW (decoupled weight decay); "
                        "basis-rotation: Adam in a rotated eigenbasis for 2-D weights (see docs/design.md); "
                        "muon: orthogonalised momentum (Newton-Schulz) for 2-D hidden weights, AdamW for the rest; "
                        "delay-nesterov: NAdam whose look-ahead grows with the stage's gradient delay (async schedules)")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-decay-style", choices=DECAY_STYLES, default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--adam-kernel", choices=["auto", "fused", "single-tensor"], default="auto",
                   help="fused: torch's fused AdamW kernel, one pass over the state (the same bits whatever "
                        "the sharding); single-tensor: torch.optim.AdamW(foreach=False)'s arithmetic, bit for "
                        "bit; auto: fused for adam/adamw, single-tensor for basis-rotation")
    add_basis_rotation_args(g)
    add_muon_args(g)
    add_delay_nesterov_args(g)


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--mock-data", action="store_true", help="synthetic, learnable token sequences (the default when no data path is given)")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="indexed dataset prefix(es) from tools/preprocess_data.py: PREFIX, or "
                        "WEIGHT1 PREFIX1 WEIGHT2 PREFIX2 ... to blend")
    g.add_argument("--split", default="969,30,1", help="train,valid,test shares of every dataset")
    g.add_argument("--data-cache-path", default=None,
                   help="where megatron-core caches sample indices (default: <prefix>/cache/ next to the data)")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    g.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json or BERT vocab.txt")
    g.add_argument("--merge-file", default=None, help="GPT-2 merges.txt")
    g.add_argument("--tokenizer-model", default=None, help="Hugging Face tokenizer.json (or its directory)")
    g.add_argument("--reset-position-ids", action="store_true", help="restart position ids after each end-of-document")
    g.add_argument("--reset-attention-mask", action="store_true", help="no attention across end-of-document tokens")
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on end-of-document tokens")


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--data-parallel-size", type=int, default=None,
                   help="replicas per stage; default: WORLD_SIZE / (PP x TP) under torchrun, else 1")
    g.add_argument("--pipeline-schedule", default=DEFAULT_SCHEDULE,
                   help=f"one of {', '.join(SCHEDULES)} (see docs/schedules); each takes its own flags below; "
                        "auto / auto-async: profile, then the fastest synchronous (auto-async: or "
                        "asynchronous) one that fits (docs/planning.md); torch-csv:PATH: replay an order "
                        "in torch.distributed.pipelining's compute-only CSV (docs/schedules.md)")
    g.add_argument("--pipeline-executor", choices=["distributed", "emulator"], default="distributed",
                   help="emulator: all stages in this one process, bitwise the same numbers")
    g.add_argument("--pipeline-layer-split", type=int, nargs="+", default=None,
                   help="explicit number of layers per stage (default: even split)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None, metavar="K",
                   help="K layers per model chunk, so each stage holds num-layers / (PP x K) chunks (virtual "
                        "stage c x PP + s is chunk c of stage s); several chunks need a schedule that runs them")
    g.add_argument("--distributed-backend", choices=["auto", "gloo", "nccl"], default="auto")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--pipeline-timeout-seconds", type=float, default=300.0,
                   help="how long a stage waits for one activation/gradient before failing")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads per process (default: cores / local processes)")
    g.add_argument("--host-malloc", choices=HOST_MALLOC_CHOICES, default="retain",
                   help="retain: glibc keeps freed host memory in the heap, so re-allocating a micro-batch's "
                        "tensors costs no page faults (1-2.5%% faster CPU training, same peak RSS); "
                        "system: the C library's defaults")
    g.add_argument("--bind-cores", choices=BIND_CORES_CHOICES, default="auto",
                   help="auto: on CPU, each local rank runs on its own equal share of the cores when the "
                        "process may use them all and there are at least as many as local ranks (1-3%% "
                        "faster on the speed benchmark); none: the scheduler places threads")
    g.add_argument("--manual-gc", action="store_true",
                   help="Python's garbage collector off during training, collecting only every "
                        "--manual-gc-interval updates and around evaluation (Megatron-LM's flag; rank processes "
                        "freeze their start-up objects out of every collection either way)")
    g.add_argument("--manual-gc-interval", type=int, default=0, metavar="N",
                   help="with --manual-gc: collect every N updates (0: never between updates)")
    g.add_argument("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
                   help="with --manual-gc: no collection before and after each evaluation")


def _add_preflight_args(p: argparse.ArgumentParser) -> None:
    """The up-front checks' switches (the checks run in :mod:`megatron.trainer.launch.preflight`)."""
    g = p.add_argument_group("memory check")
    g.add_argument("--no-memory-check", dest="memory_check", action="store_false",
                   help="start even when the per-rank memory estimate (printed in the banner) exceeds the "
                        "host's MemAvailable (CPU) or the GPU's free memory")
    g = p.add_argument_group("schedule check")
    g.add_argument("--no-schedule-check", dest="schedule_check", action="store_false",
                   help="start without replaying the schedule's first iterations through the schedule "
                        "check (a deadlock or a mismatched message then shows as a pipeline timeout)")


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--log-json", default=None, help="append one JSON object per logged iteration")
    g.add_argument("--log-weight-version-drift", action="store_true")
    g.add_argument("--inject-nonfinite-grad", action="append", default=[], metavar="STAGE:UPDATE",
                   help="testing: poison STAGE's gradients before its local update UPDATE (0-based); repeatable")
    g.add_argument("--inject-nonfinite-loss", action="append", type=int, default=[], metavar="MICROBATCH",
                   help="testing: the loss of this global micro-batch (0-based) becomes NaN; repeatable")
    g.add_argument("--dump-final-params", default=None, metavar="DIR",
                   help="write each stage's final parameters (by global name) to DIR/stageS.pt")


#: What the run derives from its flags (finalize_args, check_flags and the checks after them),
#: declared here with its value before it is decided, so every later step reads an attribute.
DERIVED_DEFAULTS = dict(
    world_size=None, num_microbatches=None, num_model_chunks=1,
    layer_split_source=None, task_checks=(),
)


def build_parser(description: str = "Megatron-Async pretraining") -> argparse.ArgumentParser:
    register_auto_selectors()  # --pipeline-schedule auto, auto-async
    p = OneLineParser(description=description, allow_abbrev=False)
    p.set_defaults(**DERIVED_DEFAULTS)
    _add_model_args(p)
    _add_training_args(p)
    _add_data_args(p)
    _add_parallel_args(p)
    add_schedule_args(p)  # every registered schedule's own flags (--zb-*, --pipemare-*, ...)
    add_run_control_args(p)
    add_exit_args(p)  # --exit-signal-handler, --exit-signal, --exit-duration-in-mins
    add_restart_args(p)  # --max-restarts (the local launcher's)
    add_insight_args(p)  # --trace-dir, --pipeline-partition
    add_mixed_precision_args(p)  # --fp16, --loss-scale, --initial-loss-scale, ...
    add_recompute_args(p)  # --recompute-granularity/-method/-num-layers, --recompute-activations
    add_ddp_args(p)  # --overlap-grad-reduce, --ddp-bucket-size
    _add_preflight_args(p)  # --no-memory-check, --no-schedule-check (the checks run in launch.preflight)
    _add_logging_args(p)
    add_megatron_compat_args(p)  # Megatron-LM's model, sample-count, rampup, loading and logging flags
    add_megatron_split_args(p)  # --decoder-first/last-pipeline-num-layers, --account-for-*, layout
    add_config_file_args(p)  # --config-file, --dump-config (config_file.py)
    return p


def finalize_args(args: argparse.Namespace) -> argparse.Namespace:
    """The flags with Megatron-LM's defaults that depend on other flags filled in (data-parallel
    size, global batch, model chunks, iteration counts from sample counts, ...): a new
    namespace, ``args`` unchanged (raise :class:`ConfigError`, one line)."""
    args = with_values(args, **_parallel_sizes(args))
    args = with_values(args, **resolve_megatron_split(args))  # Megatron-LM's split flags -> a split or chunk size
    # Model chunks per stage (Megatron's virtual pipeline size); checked in check_flags.
    pp, dp, per_chunk = args.pipeline_model_parallel_size, args.data_parallel_size, args.num_layers_per_virtual_pipeline_stage
    args = with_values(args, num_model_chunks=model_chunks(args.num_layers, pp, per_chunk),
                       num_microbatches=microbatches(args.global_batch_size, args.micro_batch_size, dp))
    return with_values(args, **finalize_megatron_compat_args(args))  # --train-samples, --*-samples, rampup


def _parallel_sizes(args: argparse.Namespace) -> dict[str, FlagValue]:
    """Data-parallel size (from ``WORLD_SIZE`` under torchrun), global batch, positions, mock data."""
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    if pp < 1 or tp < 1:
        raise ConfigError("--pipeline-model-parallel-size and --tensor-model-parallel-size must be >= 1")
    world = world_size_from_env()
    dp = args.data_parallel_size
    if dp is None:
        if world is not None and args.pipeline_executor == "distributed":
            if world % (pp * tp):
                raise ConfigError(f"WORLD_SIZE={world} is not divisible by pipeline {pp} x tensor {tp}")
            dp = world // (pp * tp)
        else:
            dp = 1
    return dict(data_parallel_size=dp, world_size=pp * tp * dp,
                global_batch_size=args.micro_batch_size * dp if args.global_batch_size is None else args.global_batch_size,
                max_position_embeddings=args.seq_length if args.max_position_embeddings is None
                else args.max_position_embeddings,
                mock_data=True if args.data_path is None else args.mock_data)


def check_model_flags(args: argparse.Namespace) -> None:
    """The sizes, batch, learning-rate and split flags, each on its own (raise :class:`ConfigError`
    with one line for the first problem found); the first checks :func:`megatron.trainer.plan.parse.parse_args` runs."""
    pp, dp = args.pipeline_model_parallel_size, args.data_parallel_size
    world = world_size_from_env()
    if world is not None and args.pipeline_executor == "distributed" and world != args.world_size:
        raise ConfigError(f"WORLD_SIZE={world} but pipeline {pp} x data {dp} x tensor "
                          f"{args.tensor_model_parallel_size} needs {args.world_size} processes")
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "train_iters", "vocab_size", "log_interval"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1")
    if not args.manual_gc and (args.manual_gc_interval or not args.manual_gc_eval):
        raise ConfigError("--manual-gc-interval/--no-manual-gc-eval need --manual-gc")
    if args.hidden_size % args.num_attention_heads:
        raise ConfigError(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {args.num_attention_heads}")
    if args.num_query_groups is not None and args.num_attention_heads % args.num_query_groups:
        raise ConfigError("--num-attention-heads must be divisible by --num-query-groups")
    if args.seq_length > args.max_position_embeddings and args.position_embedding_type == "learned_absolute":
        raise ConfigError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings {args.max_position_embeddings}")
    if args.pipeline_layer_split is not None:
        split = args.pipeline_layer_split
        if len(split) % pp:  # PP counts, or one per model chunk of a chunked layout (checked with the schedule)
            raise ConfigError(f"--pipeline-layer-split has {len(split)} entries for {pp} pipeline stages")
        if sum(split) != args.num_layers or min(split) < 1:
            raise ConfigError(f"--pipeline-layer-split {split} must be positive and sum to --num-layers {args.num_layers}")
    elif args.num_layers % pp and args.pipeline_partition not in ("balanced", "profiled"):
        raise ConfigError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp} (or pass --pipeline-layer-split)")
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise ConfigError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {dp}")
    if args.pipeline_executor == "emulator" and dp != 1:
        raise ConfigError("--pipeline-executor emulator runs one data-parallel replica; use --data-parallel-size 1")
    if not (0.0 <= args.hidden_dropout < 1.0 and 0.0 <= args.attention_dropout < 1.0):
        raise ConfigError("dropout probabilities must be in [0, 1)")
    if args.min_lr > args.lr:
        raise ConfigError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    if args.lr_warmup_iters > args.lr_decay_iters:
        raise ConfigError("--lr-warmup-iters exceeds --lr-decay-iters")
    if args.clip_grad < 0:
        raise ConfigError("--clip-grad must be >= 0")


def check_flags(args: argparse.Namespace) -> argparse.Namespace:
    """The combinations of flags, and the schedule built from them (raise :class:`ConfigError`
    with one line for the first problem found); the flags with the defaults these checks fill
    (loss scaling, rollback mode, recompute granularity, bucket size): a new namespace."""
    pp = args.pipeline_model_parallel_size
    check_tensor_parallel_flags(args)  # emulator, divisibility (padded vocab), unsupported combinations
    if args.device == "cuda" or args.bf16:
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda but no CUDA device is available")
    if args.distributed_backend == "nccl" and args.device == "cpu":
        raise ConfigError("--distributed-backend nccl needs --device cuda")
    for spec in args.inject_nonfinite_grad:
        try:
            stage, update = (int(x) for x in spec.split(":"))
        except ValueError:
            raise ConfigError(f"--inject-nonfinite-grad expects STAGE:UPDATE, got {spec!r}") from None
        if not 0 <= stage < pp:
            raise ConfigError(f"--inject-nonfinite-grad stage {stage} outside 0..{pp - 1}")
    check_schedule_flags(args)  # the schedule's own flags, chunks per stage
    args = with_values(args, **check_mixed_precision_flags(args))  # --fp16 and loss scaling; exact rollback in bf16/fp16
    check_basis_rotation_flags(args)  # --optimizer basis-rotation, --rotation-*
    check_muon_flags(args)  # --optimizer muon, --muon-*
    args = with_values(args, **check_recompute_flags(args))  # --recompute-* (Megatron-LM's rules, layers per chunk)
    args = with_values(args, **check_ddp_flags(args))  # --overlap-grad-reduce, --ddp-bucket-size
    check_megatron_compat_flags(args)  # Megatron-LM's model, rampup, loading and logging flags
    check_run_control_flags(args)  # --eval-*, --save/--load, --exit-interval, --tensorboard-dir
    check_exit_flags(args)  # --exit-signal-handler, --exit-duration-in-mins (ConfigError)
    check_restart_flags(args)  # --max-restarts: the local launcher's, with --save = --load
    for check in args.task_checks:  # a task's own flags (parser.set_defaults)
        check(build_job_config(args))
    try:
        run = RunConfig.from_args(args)  # the run plan builds it again, from the checked flags
        check_delay_nesterov_flags(args, run.schedule_cls.traits.policy_for(run.schedule).gradient_delays)
        # Build it once now: its checks run and a searched order (Zero Bubble) that cannot meet its
        # memory limit fails here, before any process starts, not at the first iteration.
        run.run_schedule(args.pipeline_schedule)
    except ScheduleConfigError as exc:
        raise ConfigError(f"--pipeline-schedule: {exc}") from None
    return args
