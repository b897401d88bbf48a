"""The start banner the logging rank prints once: flags, parameters and memory estimate per stage,
data source.

Why: a log read days later (or a Slurm job's output) must say what ran without the command
line: every flag like Megatron-LM's ``------ arguments ------`` block, how the model was cut
into stages, and where the tokens came from. Training on mock data is shouted, because a job
that silently trains on synthetic tokens wastes its allocation.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import IO

from megatron.trainer.config.job_config import flag_values
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.config.tied_args import tied_parameter_count
from megatron.trainer.optional_packages import optional_packages_line
from megatron.trainer.plan.memory_estimate import memory_banner_line
from megatron.trainer.tasks.balanced_partition import layer_split_line

MOCK_DATA_WARNING = "WARNING: training on MOCK data (no --data-path): synthetic tokens, not text"

_WIDTH = 48  # Megatron-LM's dotted column
_PLAIN = (str, int, float, bool, type(None), list, tuple, dict, set, frozenset)


def argument_lines(config: RunPlan) -> list[str]:
    """Every parsed and derived flag, sorted by name, one per line (Megatron-LM's layout)."""
    lines = ["------------------------ arguments ------------------------"]
    values = flag_values(config)
    # what this rank's host set-up did, as Megatron-LM lists its derived arguments
    values.update(core_binding_effect=config.host.core_binding, host_malloc_effect=config.host.host_malloc)
    for name in sorted(values):
        value = values[name]
        if not isinstance(value, _PLAIN):  # derived objects (the schedule's run config, the batch plan)
            continue
        dots = "." * max(1, _WIDTH - len(name))
        lines.append(f"  {name} {dots} {value}")
    lines.append("-------------------- end of arguments ---------------------")
    return lines


def data_source_line(config: RunPlan) -> str:
    """Where training samples come from; mock data as a loud warning."""
    if config.data.data_path is None:
        return MOCK_DATA_WARNING
    vocab = config.vocab.tokenizer_size
    padded = config.vocab.size
    return (f"data: --data-path {' '.join(config.data.data_path)} | --split {config.data.split} | tokenizer "
            f"{config.data.tokenizer_type} (vocabulary {vocab}, padded to {padded})")


def parameter_line(params_per_stage: Sequence[int]) -> str:
    """Parameters of each pipeline stage (one data-parallel replica) and their total."""
    per_stage = ", ".join(f"{n:,}" for n in params_per_stage)
    return f"parameters per stage: [{per_stage}] | total: {sum(params_per_stage):,}"


def banner_lines(config: RunPlan, params_per_stage: Sequence[int], executor: str) -> list[str]:
    lines = argument_lines(config)
    lines.append(f"{config.schedule.pipeline_schedule} on {config.parallel.pipeline_model_parallel_size} stages "
                 f"({executor}) | {parameter_line(params_per_stage)}")
    lines.append(layer_split_line(config))
    memory = memory_banner_line(config)
    if memory:
        lines.append(memory)
    tied = tied_parameter_count(config)
    count = f" | tied parameters: {tied:,} (counted once)" if tied else ""
    lines.append(config.embeddings.line + count)
    lines.append(data_source_line(config))
    optional = optional_packages_line()
    if optional:
        lines.append(optional)
    return lines


def print_banner(config: RunPlan, params_per_stage: Sequence[int], executor: str, stream: IO[str]) -> None:
    """``executor`` says what runs the stages: the emulator, or one process per rank."""
    print("\n".join(banner_lines(config, params_per_stage, executor)), file=stream, flush=True)
