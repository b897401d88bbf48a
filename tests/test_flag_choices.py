"""Every name a flag offers (``megatron/trainer/config/choices.py``) has its implementation, and
every implementation is offered: the parser sits below the packages it names, so the two lists
are written apart and only this test ties them."""
from __future__ import annotations

import pytest

from megatron.trainer.config import choices
from megatron.trainer.config.arguments import build_parser
from megatron.trainer.optim.lr_schedule import LRSchedule
from megatron.trainer.optim.registry import OPTIMIZERS


def _choices(dest: str) -> tuple:
    action = next(a for a in build_parser()._actions if a.dest == dest)
    return tuple(action.choices)


def test_every_optimizer_name_is_registered() -> None:
    assert set(choices.OPTIMIZER_NAMES) == set(OPTIMIZERS)
    assert set(_choices("optimizer")) - {"sgd"} == set(OPTIMIZERS)  # sgd: refused with one line


@pytest.mark.parametrize("dest, names", [
    ("tokenizer_type", choices.TOKENIZER_TYPES), ("lr_decay_style", choices.DECAY_STYLES),
    ("host_malloc", choices.HOST_MALLOC_CHOICES), ("bind_cores", choices.BIND_CORES_CHOICES),
    ("recompute_granularity", choices.RECOMPUTE_GRANULARITIES), ("recompute_method", choices.RECOMPUTE_METHODS),
])
def test_the_parser_offers_the_declared_names(dest: str, names: tuple) -> None:
    assert set(_choices(dest)) == set(names)


@pytest.mark.parametrize("style", choices.DECAY_STYLES)
def test_every_decay_style_has_a_schedule(style: str) -> None:
    fields = dict(max_lr=1.0, min_lr=0.1, warmup_steps=0, decay_steps=10, decay_style=style)
    if style == "WSD":
        fields.update(wsd_decay_steps=5, wsd_decay_style=choices.WSD_DECAY_STYLES[0])
    schedule = LRSchedule(**fields)
    assert 0.1 <= schedule.lr(5) <= 1.0
