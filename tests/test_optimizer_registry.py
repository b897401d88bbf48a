"""``--optimizer`` comes from the optimizer registry, and every registered builder steps a stage."""
from __future__ import annotations

import pytest
import torch

from megatron.trainer.plan.parse import parse_args, parse_run_plan
from megatron.trainer.optim.registry import OPTIMIZERS, build_optimizer


# Optimizers that adapt to a gradient delay need a schedule that declares one.
SCHEDULE = {"delay-nesterov": ["--pipeline-schedule", "paci"]}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_registered_optimizer_parses_builds_and_steps_through_data(name):
    config = parse_run_plan(["--mock-data", "--optimizer", name, "--pipeline-executor", "emulator",
                               *SCHEDULE.get(name, [])])
    weight = torch.nn.Parameter(torch.ones(4, 3))
    optimizer = build_optimizer(config, [("layer.weight", weight)], stage=0)
    weight.grad = torch.full_like(weight, 0.5)
    version = weight._version
    optimizer.step(lr=1e-2)
    assert not torch.equal(weight.detach(), torch.ones(4, 3)), f"{name} did not update the weight"
    assert weight._version == version, f"{name} stepped in a way autograd's version counter sees"


def test_an_unregistered_optimizer_is_refused_with_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--mock-data", "--optimizer", "lamb"])
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
