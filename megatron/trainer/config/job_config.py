"""What the user asked for: frozen dataclasses, one per concern, built once from the flags.

``parse_args`` checks Megatron-LM's flags (every flag and every refusal stays where
Megatron-LM users expect it) and fills Megatron-LM's defaults that depend on other flags into a
new namespace; :func:`build_job_config` then files each value into the section of its concern
and checks that none is left over, so a flag added without a home fails the tests, not a run.
Everything below ``config/`` reads the sections' fields: ``config.model.hidden_size``,
``config.parallel.pipeline_model_parallel_size``.

The sections are frozen, and hold no value derived from the data, the cost model, the schedule
or the host: those (the padded vocabulary, the layer split, the built schedule's config and
layout, the batch plan, the tie, the memory estimate, the host set-up, ``auto``'s layouts) are
the run plan's (:mod:`megatron.trainer.config.run_plan`). Field names are the flags' ``dest``
names, so a flag's documentation is ``--help``.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from megatron.pipeline.schedules import ScheduleConfig, schedule_class
from megatron.trainer.config.run_config import schedule_config_of
from megatron.trainer.config.values import FlagValue


@dataclass(frozen=True)
class ModelConfig:
    """The network: sizes, vocabulary, normalization, positions, tying."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int | None
    num_attention_heads: int
    num_query_groups: int | None
    group_query_attention: bool
    kv_channels: int | None
    seq_length: int
    max_position_embeddings: int
    #: ``--vocab-size``: the mock data's and NullTokenizer's ids (the model's vocabulary, padded
    #: from a tokenizer's, is the run plan's ``vocab``)
    vocab_size: int
    make_vocab_size_divisible_by: int
    hidden_dropout: float
    attention_dropout: float
    init_method_std: float
    normalization: str
    norm_epsilon: float
    position_embedding_type: str
    rotary_base: int
    rotary_percent: float
    swiglu: bool
    add_bias_linear: bool
    transformer_impl: str
    attention_backend: str
    untie_embeddings_and_output_weights: bool


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of the parallel dimensions, the layer split, data-parallel gradient reduction."""

    pipeline_model_parallel_size: int
    tensor_model_parallel_size: int
    data_parallel_size: int
    sequence_parallel: bool
    num_layers_per_virtual_pipeline_stage: int | None
    #: the user's split (the run's, decided from it, is the run plan's ``layers``)
    pipeline_layer_split: list[int] | None
    decoder_first_pipeline_num_layers: int | None
    decoder_last_pipeline_num_layers: int | None
    account_for_embedding_in_pipeline_split: bool
    account_for_loss_in_pipeline_split: bool
    pipeline_model_parallel_layout: str | None
    distribute_saved_activations: bool
    pipeline_partition: str | None
    pipeline_partition_memory_gb: float | None
    pipeline_partition_profile_iters: int
    overlap_grad_reduce: bool
    ddp_bucket_size: int | None
    use_distributed_optimizer: bool
    overlap_param_gather: bool

    @property
    def world_size(self) -> int:
        """Processes of the run: pipeline x tensor x data-parallel size."""
        return self.pipeline_model_parallel_size * self.tensor_model_parallel_size * self.data_parallel_size


@dataclass(frozen=True)
class ScheduleSettings:
    """Which schedule runs, on which executor, and its own flags (the run plan's ``run`` is built
    from them: :class:`~megatron.trainer.config.run_plan.RunPlan`)."""

    pipeline_schedule: str
    pipeline_executor: str
    schedule_check: bool
    #: every registered schedule's own flags by ``dest`` (``Schedule.traits.flag_groups``)
    flags: dict[str, FlagValue]

    def flag(self, dest: str) -> FlagValue:
        """One schedule flag's value (a :class:`KeyError` names an unknown one)."""
        return self.flags[dest]


@dataclass(frozen=True)
class TrainingConfig:
    """Batch, length, seed, evaluation."""

    micro_batch_size: int
    global_batch_size: int
    train_iters: int
    train_samples: int | None
    seed: int
    rampup_batch_size: list[int] | None
    eval_interval: int | None
    eval_iters: int


@dataclass(frozen=True)
class OptimizerConfig:
    """The update rule and its learning-rate schedule."""

    optimizer: str
    lr: float
    min_lr: float
    lr_warmup_iters: int
    lr_decay_iters: int
    lr_decay_style: str
    lr_warmup_samples: int
    lr_decay_samples: int | None
    lr_warmup_fraction: float | None
    lr_wsd_decay_style: str
    lr_wsd_decay_iters: int | None
    lr_wsd_decay_samples: int | None
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    #: what runs (``auto`` resolved)
    adam_kernel: str
    rotation_geometry: str
    rotation_source: str
    rotation_refresh_interval: int
    rotation_stage_aware: bool
    muon_momentum: float = 0.95
    muon_use_nesterov: bool = False
    muon_num_ns_steps: int = 5
    muon_scale_mode: str = "spectral"
    muon_extra_scale_factor: float = 1.0
    muon_split_qkv: bool = True
    muon_ns_dtype: str = "float32"
    lookahead_max_momentum: float = 0.99
    nadam_momentum_decay: float = 0.004


@dataclass(frozen=True)
class PrecisionConfig:
    """Half precision and loss scaling."""

    bf16: bool
    fp16: bool
    loss_scale: float | None
    initial_loss_scale: float | None
    min_loss_scale: float | None
    loss_scale_window: int | None
    hysteresis: int | None
    optimizer_post_validation_in_place: bool


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recompute (Megatron-LM's rules)."""

    recompute_activations: bool
    recompute_granularity: str | None
    recompute_method: str | None
    recompute_num_layers: int | None
    recompute_modules: list[str] | None
    recompute_stash_weights: bool


@dataclass(frozen=True)
class DataConfig:
    """Datasets and tokenizer."""

    mock_data: bool
    data_path: list[str] | None
    split: str
    data_cache_path: str | None
    tokenizer_type: str | None
    vocab_file: str | None
    merge_file: str | None
    tokenizer_model: str | None
    reset_position_ids: bool
    reset_attention_mask: bool
    eod_mask_loss: bool


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving and loading."""

    save: str | None
    save_interval: int | None
    load: str | None
    no_load_optim: bool
    finetune: bool


@dataclass(frozen=True)
class ExitConfig:
    """Graceful stops: an iteration count, a signal, a wall-time budget."""

    exit_interval: int | None
    exit_signal_handler: bool
    exit_signal: str | None
    exit_duration_in_mins: float | None
    exit_check_interval: int | None


@dataclass(frozen=True)
class LoggingConfig:
    """What the run reports, and the fault injections of the tests."""

    log_interval: int
    log_json: str | None
    log_throughput: bool
    log_params_norm: bool
    log_weight_version_drift: bool
    log_activation_memory: bool
    trace_dir: str | None
    tensorboard_dir: str | None
    wandb_project: str | None
    wandb_exp_name: str | None
    wandb_save_dir: str | None
    dump_final_params: str | None
    inject_nonfinite_grad: list[str]
    inject_nonfinite_loss: list[int]

    @property
    def nonfinite_injections(self) -> dict[int, set[int]]:
        """``--inject-nonfinite-grad`` parsed: stage -> local updates to poison (the flag
        checks refused a malformed one)."""
        injections: dict[int, set[int]] = {}
        for spec in self.inject_nonfinite_grad:
            stage, update = (int(x) for x in spec.split(":"))
            injections.setdefault(stage, set()).add(update)
        return injections


@dataclass(frozen=True)
class LaunchConfig:
    """Processes and devices: backend, timeouts, threads, memory, restarts, host set-up."""

    device: str
    distributed_backend: str
    distributed_timeout_minutes: float
    pipeline_timeout_seconds: float
    num_threads: int | None
    host_malloc: str
    bind_cores: str
    manual_gc: bool
    manual_gc_interval: int
    manual_gc_eval: bool
    max_restarts: int
    memory_check: bool


@dataclass(frozen=True)
class TaskOptions:
    """A model family's own flags (``PretrainTask.add_arguments``, which names its subclass with
    ``parser.set_defaults(task_options=...)``); GPT has none."""

    #: what the cost models count: "gpt", "bert" (a pooler and heads) or "synthetic" (no layers)
    model_family: ClassVar[str] = "gpt"


@dataclass(frozen=True)
class JobConfig:
    """Everything a run was asked to do, by concern."""

    model: ModelConfig
    parallel: ParallelConfig
    schedule: ScheduleSettings
    training: TrainingConfig
    optimizer: OptimizerConfig
    precision: PrecisionConfig
    recompute: RecomputeConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    exit: ExitConfig
    logging: LoggingConfig
    launch: LaunchConfig
    task: TaskOptions = field(default_factory=TaskOptions)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per iteration and data-parallel replica (at the final global batch)."""
        return microbatches(self.training.global_batch_size, self.training.micro_batch_size,
                            self.parallel.data_parallel_size)

    @property
    def num_model_chunks(self) -> int:
        """Model chunks per stage (Megatron's virtual pipeline size)."""
        return model_chunks(self.model.num_layers, self.parallel.pipeline_model_parallel_size,
                            self.parallel.num_layers_per_virtual_pipeline_stage)


def microbatches(global_batch: int, micro_batch: int, data_parallel: int) -> int:
    """Megatron-LM's micro-batches per iteration and data-parallel replica."""
    return global_batch // max(1, micro_batch * data_parallel)


def model_chunks(num_layers: int, pipeline: int, layers_per_chunk: int | None) -> int:
    """Megatron-LM's virtual pipeline size: chunks of ``layers_per_chunk`` layers per stage."""
    return max(1, num_layers // (pipeline * layers_per_chunk)) if layers_per_chunk and layers_per_chunk > 0 else 1


S = TypeVar("S")


def replace_in(config: JobConfig, section: str, **values: Any) -> JobConfig:
    """A copy of ``config`` with fields of one section replaced: the one way to change a built
    config (``replace_in(config, "parallel", pipeline_layer_split=[3, 5])``)."""
    return dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **values)})


SECTION_TYPES: dict[str, type] = {
    "model": ModelConfig, "parallel": ParallelConfig, "schedule": ScheduleSettings, "training": TrainingConfig,
    "optimizer": OptimizerConfig, "precision": PrecisionConfig, "recompute": RecomputeConfig, "data": DataConfig,
    "checkpoint": CheckpointConfig, "exit": ExitConfig, "logging": LoggingConfig, "launch": LaunchConfig,
}
# Namespace attributes with another name in the config (the namespace's are private).
RENAMED: dict[str, str] = {}
# Fields that are no flag's value: the schedule's flag dict itself.
NOT_FLAGS = frozenset({"flags"})
# Namespace attributes that are not configuration: the task's flag checks, the Megatron-LM
# split flags a split was translated from (the run plan's ``layers.source``), and the sizes the
# flag checks read that the config computes from its fields (``world_size``, ...).
NOT_CONFIG = frozenset({"task_checks", "task_options", "layer_split_source", "world_size", "num_microbatches",
                        "num_model_chunks"})


def job_schedule_config(config: JobConfig) -> ScheduleConfig:
    """:func:`schedule_config` of a built (or provisional: the flag checks') job config."""
    parallel, schedule, training = config.parallel, config.schedule, config.training
    schedule_cls = schedule_class(schedule.pipeline_schedule)
    flags = {flag.dest: schedule.flags[flag.dest] for group in schedule_cls.traits.flag_groups for flag in group.flags}
    return schedule_config_of(schedule_cls, parallel.pipeline_model_parallel_size,
                            config.num_microbatches, training.train_iters,
                            config.num_model_chunks, parallel.data_parallel_size, flags)


def flag_values(config: JobConfig) -> dict[str, object]:
    """Every field of every section (the task's and the schedule's flags included) by its
    flag's ``dest``: the banner's argument list, and what a derived command line forwards."""
    values: dict[str, object] = {}
    for section in (*(getattr(config, name) for name in SECTION_TYPES), config.task):
        values.update((f.name, getattr(section, f.name)) for f in dataclasses.fields(section)
                      if f.name not in NOT_FLAGS)
    values.update(config.schedule.flags)
    return values


class UnplacedFlagError(RuntimeError):
    """A namespace value no section has a field for (a programming error, found by the tests)."""


def build_job_config(args: argparse.Namespace, ignore: Iterable[str] = ()) -> JobConfig:
    """File every value of the checked namespace ``args`` into its section; raises
    :class:`UnplacedFlagError` for a value without a field, so none is silently dropped.

    The flag checks also call it on a namespace still being checked, to hand the functions
    they share with the run (tokenizer, data, layer split) the same typed view. ``ignore``:
    a tool's own flags on top of the trainer's (the planner's)."""
    from megatron.pipeline.schedules import flag_groups

    task_options: type[TaskOptions] = vars(args).get("task_options", TaskOptions)
    skip = NOT_CONFIG | set(ignore)
    values = {RENAMED.get(k, k): v for k, v in vars(args).items() if k not in skip}
    schedule_dests = {flag.dest for group in flag_groups() for flag in group.flags}
    placed: set[str] = set()

    def take(cls: type[S]) -> S:
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        kwargs = {name: values[name] for name in names if name in values}
        placed.update(kwargs)
        return cls(**kwargs)

    flags = {dest: values[dest] for dest in schedule_dests if dest in values}
    placed.update(flags)
    sections: dict[str, object] = {}
    for name, cls in SECTION_TYPES.items():
        if cls is ScheduleSettings:
            placed.update(("pipeline_schedule", "pipeline_executor", "schedule_check"))
            sections[name] = ScheduleSettings(values["pipeline_schedule"], values["pipeline_executor"],
                                              values["schedule_check"], flags)
        else:
            sections[name] = take(cls)
    sections["task"] = take(task_options)
    left = sorted(set(values) - placed)
    if left:
        raise UnplacedFlagError(f"no JobConfig section has a field for {', '.join(left)}")
    return JobConfig(**sections)
