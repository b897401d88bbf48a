"""What the runtime calls on a stage's optimizer and on a schedule is declared (issue 30): every
``<optimizer>.name`` the runtime, the loop and checkpoints use is a member of
:class:`~megatron.pipeline.runtime.stage_optimizer.StageOptimizer`, the optimizers subclass it,
and the schedule hooks have defaults on :class:`~megatron.pipeline.schedules.base.Schedule`."""
from __future__ import annotations

import re
from pathlib import Path

from megatron.pipeline.runtime.stage_optimizer import StageOptimizer
from megatron.pipeline.schedules import ScheduleConfig, build_schedule

ROOT = Path(__file__).resolve().parents[1]
CALLERS = ("megatron/pipeline/runtime", "megatron/trainer/loop", "megatron/trainer/checkpointing")
USE = re.compile(r"\b(?:setup\.optimizer|self\.setup\.optimizer|opt)\.([a-z_]+)")
#: ``getattr(obj, "name", ...)`` / ``hasattr(obj, "name")`` with a literal name
PROBE = re.compile(r"\b(?:getattr|hasattr)\(\s*([\w.]+)\s*,\s*[\"'](\w+)[\"']")


def test_every_optimizer_member_the_runtime_uses_is_declared() -> None:
    used = {name for folder in CALLERS for path in (ROOT / folder).rglob("*.py")
            for name in USE.findall(path.read_text())}
    assert used, "the pattern must find the runtime's calls"
    assert sorted(name for name in used if not hasattr(StageOptimizer, name)) == []


def test_nothing_probes_an_optimizer_or_a_schedule() -> None:
    """The callers call declared members; a ``getattr``/``hasattr`` on an optimizer or a
    schedule, or for a member name the contracts declare, means a member is missing there."""
    from megatron.pipeline.schedules.base import Schedule

    def probes_contract(obj: str, name: str) -> bool:
        return (re.search(r"(?:^|\.)(?:opt|optimizer|schedule)$", obj) is not None
                or name in ("optimizer", "schedule")
                or hasattr(StageOptimizer, name) or hasattr(Schedule, name))

    probes = [f"{path.relative_to(ROOT)}: {obj}.{name}" for folder in CALLERS
              for path in sorted((ROOT / folder).rglob("*.py"))
              for obj, name in PROBE.findall(path.read_text()) if probes_contract(obj, name)]
    assert probes == []


def test_the_optimizers_subclass_the_contract() -> None:
    from megatron.pipeline.runtime.distributed_optimizer import DataParallelShardedOptimizer
    from megatron.trainer.optim.adamw import StageAdamW

    assert issubclass(StageAdamW, StageOptimizer)
    assert issubclass(DataParallelShardedOptimizer, StageOptimizer)


def test_schedule_hooks_have_defaults() -> None:
    asynchronous = build_schedule("pipedream-2bw", ScheduleConfig(2, 2, num_iterations=None))
    policy = asynchronous.policy
    assert policy.post_validated is False and policy.post_validation is None
    assert policy.checkpoint.save() is None and policy.start_lines() is None
    policy.checkpoint.restore({"ignored": True})  # a schedule that decides nothing ignores it
