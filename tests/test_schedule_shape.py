"""``Schedule`` is an order, a check and a policy (issue #40): at most eight members.

Everything else a consumer needs (weights, learning rate, optimizer sharding, post-validation,
checkpoint state, reshard refusal, banner lines) is a field of the frozen ``SchedulePolicy``,
and a schedule's options are a typed dataclass, so a new need is a field, never another hook
on the base class. Counted on the class body's source (``ast``): every method, property and
class attribute, public or private.
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from megatron.pipeline.schedules import SCHEDULES, ScheduleConfig, ScheduleOptions, SchedulePolicy, build_schedule
from megatron.pipeline.schedules.base import Schedule

BASE = Path(__file__).resolve().parents[1] / "megatron" / "pipeline" / "schedules" / "base.py"
MAX_MEMBERS = 8


def schedule_members() -> list[str]:
    """Names defined on the body of ``class Schedule`` in schedules/base.py."""
    tree = ast.parse(BASE.read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Schedule").body
    names: list[str] = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.append(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
        elif isinstance(node, ast.Assign):
            names.extend(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def test_schedule_has_at_most_eight_members() -> None:
    members = schedule_members()
    assert len(members) == len(set(members))
    assert len(members) <= MAX_MEMBERS, members
    own = {k for k in vars(Schedule) if not (k.startswith("__") and k.endswith("__")) or k == "__init__"}
    assert own - {"_abc_impl"} <= set(members) | {"__annotations__"}, own


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_has_a_frozen_policy_and_typed_options(name: str) -> None:
    cls = SCHEDULES[name]
    config = ScheduleConfig(4, 8, None if cls.traits.asynchronous else 1, num_chunks=2 if cls.traits.takes_model_chunks else 1)
    if name == "async-1f1b":
        config = dataclasses.replace(config, num_microbatches=1)
    schedule = build_schedule(name, config)
    policy = schedule.policy
    assert isinstance(policy, SchedulePolicy) and policy is schedule.policy  # built once
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.reshard_refusal = "no"  # type: ignore[misc]
    assert len(policy.weight_copies) == len(policy.weight_policies) == len(policy.stage_lr) == config.num_stages
    assert policy.layout == schedule.layout == cls.traits.layout_of(config)
    assert issubclass(cls.traits.options, ScheduleOptions) and dataclasses.is_dataclass(cls.traits.options)
    assert schedule.segment(0, 1).policy is not policy  # a segment builds its own
