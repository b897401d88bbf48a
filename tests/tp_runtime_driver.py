"""Several training runs on one set of forked gloo ranks: ``python tests/tp_runtime_driver.py RUNS.json [RANKS]``
(4 ranks by default).

Why: a launch of ``pretrain_gpt.py`` pays for importing torch and megatron-core and for the
rendezvous every time; a test that trains a dozen schedules at TP = 2 pays that once here.
``RUNS.json`` is a list of argument lists (each one ``pretrain_gpt.py``'s flags, with its own
``--log-json`` / ``--dump-final-params``); every rank runs them in order through the same
driver as ``pretrain_gpt.py`` (:func:`~megatron.trainer.loop.training.rank_transport` and
:func:`~megatron.trainer.loop.training.drive`), each on fresh process groups.
"""
from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_WORLD_SIZE = 4


def _rank(runs: list[list[str]]) -> int:
    import torch
    import torch.distributed as dist

    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.loop.training import drive, rank_transport
    from megatron.trainer.tasks.gpt import GPTTask

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    task = GPTTask()
    for argv in runs:
        parser = build_parser()
        task.add_arguments(parser)
        config = parse_run_plan(argv, parser)
        config, groups, transport = rank_transport(task, config, torch.device("cpu"))
        drive(task, config, transport, torch.device("cpu"), None)
        dist.barrier(group=groups.reports)
    dist.destroy_process_group()
    return 0


def main() -> int:
    from megatron.trainer.launch.launcher import launch_local

    runs = json.loads(Path(sys.argv[1]).read_text())
    os.environ["OMP_NUM_THREADS"] = "1"
    import megatron.trainer.loop.training  # noqa: F401 - imported once, before the ranks fork
    import megatron.trainer.tasks.gpt  # noqa: F401
    world_size = int(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_WORLD_SIZE
    return launch_local(world_size, [], target=lambda: _rank(runs), grace_seconds=10)


if __name__ == "__main__":
    sys.exit(main())
