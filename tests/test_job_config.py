"""The typed job config: every flag has exactly one home, sections are frozen, later decisions
make new configs (issue 30)."""
from __future__ import annotations

import dataclasses

import pytest

from megatron.pipeline.schedules import flag_groups
from megatron.trainer.config.arguments import build_parser
from megatron.trainer.plan.parse import parse_args, parse_job_config
from megatron.trainer.config.job_config import (
    NOT_CONFIG, RENAMED, SECTION_TYPES, JobConfig, UnplacedFlagError, build_job_config, flag_values, replace_in)
from megatron.trainer.tasks.bert import BertTask
from megatron.trainer.tasks.gpt import GPTTask
from megatron.trainer.tasks.synthetic import SyntheticCostTask

ARGV = ["--pipeline-model-parallel-size", "2", "--num-layers", "4"]


@pytest.mark.parametrize("task", [GPTTask(), BertTask(), SyntheticCostTask()], ids=lambda t: t.name)
def test_every_parsed_value_has_exactly_one_field(task) -> None:
    """Walk every option of the parser (the task's included) and every derived value: each
    lands in one section, none in two, none dropped (build_job_config refuses a leftover)."""
    parser = build_parser()
    task.add_arguments(parser)
    args = parse_args([*ARGV, "--seq-length", "32"], parser)
    config = build_job_config(args)
    homes: dict[str, list[str]] = {}
    for name, cls in SECTION_TYPES.items():
        for f in dataclasses.fields(cls):
            homes.setdefault(f.name, []).append(name)
    for f in dataclasses.fields(config.task):
        homes.setdefault(f.name, []).append("task")
    schedule_flags = {flag.dest for group in flag_groups() for flag in group.flags}
    for dest in vars(args):
        if dest in NOT_CONFIG:
            continue
        name = RENAMED.get(dest, dest)
        where = homes.get(name, []) + (["schedule.flags"] if name in schedule_flags else [])
        if name in ("pipeline_schedule", "pipeline_executor", "run", "schedule_check"):
            where = where or ["schedule"]
        assert len(where) == 1, (dest, where)
    values = flag_values(config)
    for dest, value in vars(args).items():
        if dest not in NOT_CONFIG and RENAMED.get(dest, dest) in values:
            assert values[RENAMED.get(dest, dest)] == value, dest


def test_a_value_without_a_home_is_refused() -> None:
    args = parse_args(ARGV)
    args.no_such_flag = 1
    with pytest.raises(UnplacedFlagError, match="no_such_flag"):
        build_job_config(args)


def test_sections_are_frozen_and_replace_in_makes_a_new_config() -> None:
    config = parse_job_config(ARGV)
    assert isinstance(config, JobConfig)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.parallel.pipeline_layer_split = [1, 3]  # type: ignore[misc]
    split = replace_in(config, "parallel", pipeline_layer_split=[1, 3])
    assert split.parallel.pipeline_layer_split == [1, 3] and config.parallel.pipeline_layer_split is None
    assert split.model is config.model  # the other sections are shared, not copied
