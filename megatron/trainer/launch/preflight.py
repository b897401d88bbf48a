"""The up-front checks of a launch, before any rank starts (module docstrings of the checks).

The schedule's own check (a replay of its first iterations) runs after ``auto`` planned the run
(:func:`megatron.trainer.loop.trainer.preflight`), because what ``auto`` decides first (its
memory limit, its layout) is what the replay must check."""
from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from collections.abc import Iterator

from megatron.trainer.checkpointing.load import check_resume_or_exit
from megatron.trainer.config.arguments import build_parser
from megatron.trainer.config.config_file import parse_command_line
from megatron.trainer.config.errors import ConfigError
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.config.plan_file import handed_plan
from megatron.trainer.environment import is_worker_process
from megatron.trainer.launch.host import runs_on_cpu
from megatron.trainer.launch.memory_check import check_memory
from megatron.trainer.plan.parse import checked_plan
from megatron.trainer.tasks.task import PretrainTask


@contextlib.contextmanager
def refused_in_one_line() -> Iterator[None]:
    """A :class:`ConfigError` raised inside: its one ``error:`` line, and exit status 2."""
    try:
        yield
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


def check_launch(task: PretrainTask, argv: list[str]) -> tuple[RunPlan, argparse.Namespace | None]:
    """Every up-front check of a launch but the schedule's: flags, data, tokenizer, paths,
    (outside a rank) the checkpoint's files and the memory estimate; exits with status 2 and one
    ``error:`` line on the first problem. Returns the run plan and the user's flags as parsed
    (what ``auto`` derives its other layouts from); a rank our launcher started takes the
    launcher's plan (flags None) and runs only its own device's checks."""
    plan = handed_plan() if is_worker_process() else None
    flags = None
    if plan is None:
        parser = build_parser(f"Megatron-Async {task.name} pretraining")
        task.add_arguments(parser)
        command = parse_command_line(parser, argv)  # argv over --config-file's flags
        flags = copy.deepcopy(command.args)  # the user's flags as given (auto derives its other layouts from them)
        plan = checked_plan(parser, command)
    if not is_worker_process():  # a bad checkpoint fails here, before any rank starts
        check_resume_or_exit(task, plan)
    with refused_in_one_line():  # a run that cannot fit memory: refused here, not inside a rank
        plan = check_memory(plan, is_worker_process(), not runs_on_cpu(plan))
    return plan, flags
