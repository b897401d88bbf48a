"""``docs/adding_a_schedule.md`` holds: its example file and registry line are all a schedule needs.

The test executes the page's code blocks as written (the schedule module, then the registry
line against a monkeypatched registry) and checks that the trainer, untouched, parses the new
schedule's flag, refuses it under another schedule, checks its value, and trains with it in the
emulator. The reference: extra warm-up forwards change the order, not the arithmetic, so the
parameters must equal 1F1B's bitwise.
"""
from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

from async_helpers import TINY_GPT, emulate, final_params
from megatron.pipeline.schedules import SCHEDULES, build_schedule
from megatron.trainer.plan.parse import parse_args, parse_run_plan

DOC = Path(__file__).resolve().parents[1] / "docs" / "adding_a_schedule.md"
NO_DROPOUT = ("--hidden-dropout", "0", "--attention-dropout", "0")


def _code_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.fixture
def documented_schedule(monkeypatch: pytest.MonkeyPatch) -> type:
    """The page's schedule, registered by the page's registry line (registry restored after)."""
    module_source, registry_line = _code_blocks()[:2]
    module = types.ModuleType("documented_schedule")
    monkeypatch.setitem(sys.modules, module.__name__, module)  # as an imported file is (its dataclasses need it)
    exec(compile(module_source, str(DOC), "exec"), module.__dict__)
    registry = dict(SCHEDULES)
    exec(registry_line, {"SCHEDULES": registry, "Warm1F1B": module.Warm1F1B})
    assert set(registry) - set(SCHEDULES) == {"warm-1f1b"}, "the registry line must add the new schedule"
    monkeypatch.setitem(SCHEDULES, "warm-1f1b", registry["warm-1f1b"])
    return registry["warm-1f1b"]


def _argv(schedule: str, *extra: str) -> list[str]:
    return [*TINY_GPT, *NO_DROPOUT, "--num-layers", "2", "--pipeline-model-parallel-size", "2",
            "--global-batch-size", "4", "--train-iters", "2", "--log-interval", "1",
            "--pipeline-executor", "emulator", "--pipeline-schedule", schedule, *extra]


def _refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        parse_args(argv)
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_the_flag_is_parsed_into_the_schedules_options(documented_schedule: type) -> None:
    run = parse_run_plan(_argv("warm-1f1b", "--extra-warmup", "2")).run
    assert run.schedule_cls is documented_schedule
    assert run.schedule.options.extra_warmup == 2
    warm = build_schedule("warm-1f1b", run.schedule).stage_ops(1)
    plain = build_schedule("1f1b", run.schedule).stage_ops(1)
    assert [op.kind.name for op in warm][:3] == ["F", "F", "F"] != [op.kind.name for op in plain][:3]


def test_the_flag_is_refused_elsewhere_and_checked(documented_schedule: type, capsys) -> None:
    assert "--extra-warmup needs --pipeline-schedule warm-1f1b; got 1f1b" in _refusal(
        _argv("1f1b", "--extra-warmup", "1"), capsys)
    assert "--extra-warmup must lie in [0, micro-batches per iteration 4), got 4" in _refusal(
        _argv("warm-1f1b", "--extra-warmup", "4"), capsys)


def test_it_trains_like_1f1b_in_the_emulator(documented_schedule: type, megatron_world1: None) -> None:
    warm = final_params(emulate(_argv("warm-1f1b", "--extra-warmup", "2")))
    plain = final_params(emulate(_argv("1f1b")))
    assert warm.keys() == plain.keys()
    assert all(torch.equal(warm[k], plain[k]) for k in plain)
