"""The run plan, handed from the launcher to its ranks.

The local launcher parses, checks and plans once; each rank it starts (forked, or a fresh
``python`` on GPU) reads the plan from the file named by :data:`RUN_PLAN_ENV` instead of
parsing argv again, so every rank runs what the launcher decided (``auto``'s layouts and
memory limit included). The file is written by the launcher for its own ranks and removed
when they end. Under torchrun or Slurm there is no launcher of ours: each rank plans from argv
itself.
"""
from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from megatron.trainer.config.run_plan import RunPlan

RUN_PLAN_ENV = "MEGATRON_ASYNC_RUN_PLAN"


def write_run_plan(plan: RunPlan, path: str) -> None:
    with open(path, "wb") as f:
        pickle.dump(plan, f, protocol=pickle.HIGHEST_PROTOCOL)


def read_run_plan(path: str) -> RunPlan:
    with open(path, "rb") as f:
        plan = pickle.load(f)
    if not isinstance(plan, RunPlan):
        raise TypeError(f"{RUN_PLAN_ENV}={path} holds a {type(plan).__name__}, not a run plan")
    return plan


def handed_plan() -> RunPlan | None:
    """The launcher's plan in one of its ranks; None elsewhere (plan from argv)."""
    path = os.environ.get(RUN_PLAN_ENV)
    return None if path is None else read_run_plan(path)


@contextmanager
def run_plan_file(plan: RunPlan) -> Iterator[dict[str, str]]:
    """The environment that hands ``plan`` to the ranks started inside the block."""
    directory = tempfile.mkdtemp(prefix="megatron-async-plan-")
    path = os.path.join(directory, "run_plan.pkl")
    try:
        write_run_plan(plan, path)
        yield {RUN_PLAN_ENV: path}
    finally:
        shutil.rmtree(directory, ignore_errors=True)
