"""The garbage-collection policy of a training run: start-up objects frozen, ``--manual-gc``."""
from __future__ import annotations

import gc
import weakref

import pytest

from async_helpers import emulate, tiny_args
from megatron.trainer.launch.python_gc import CollectorPolicy


class _Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def collector_state():
    """Leave the collector as found (a failing test must not leave it disabled or frozen)."""
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


def test_training_collects_then_freezes_and_restores_afterwards(collector_state) -> None:
    garbage = _Cycle()
    dead = weakref.ref(garbage)
    del garbage  # unreachable, but only the cyclic collector frees it
    assert dead() is not None
    with CollectorPolicy().training():
        assert dead() is None, "start-up garbage was frozen instead of collected"
        assert gc.get_freeze_count() > 0 and gc.isenabled()
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_the_emulator_neither_collects_nor_freezes_at_the_start(monkeypatch: pytest.MonkeyPatch,
                                                                collector_state) -> None:
    calls: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(1) or 0)
    with CollectorPolicy(freeze_startup=False).training():
        assert gc.get_freeze_count() == 0 and gc.isenabled()
    assert calls == []


def test_manual_gc_disables_the_collector_for_training_only(collector_state) -> None:
    with CollectorPolicy(manual=True).training():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()  # a caller that had it off gets it back off
    with CollectorPolicy(manual=True).training():
        pass
    assert not gc.isenabled()


def test_interval_collects_once_per_due_update_however_many_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = CollectorPolicy(manual=True, interval=3)
    calls: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(1) or 0)
    for update in range(9):
        for _stage in range(2):  # the emulator's stages each report the same update
            policy.after_update(update)
    assert len(calls) == 3  # after updates 2, 5, 8
    policy.evaluation_boundary()
    assert len(calls) == 4
    assert CollectorPolicy(manual=True, interval=3, around_evaluation=False).evaluation_boundary() is None
    automatic = CollectorPolicy(manual=False)
    for update in range(9):
        automatic.after_update(update)
    automatic.evaluation_boundary()
    assert len(calls) == 4  # without --manual-gc nothing is collected by hand


def test_manual_gc_run_collects_every_interval_and_restores_the_collector(
        megatron_world1, collector_state, tmp_path) -> None:
    manual: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2 and not gc.isenabled():
            manual.append(1)  # automatic collection is off: this one was asked for

    gc.callbacks.append(record)
    try:
        emulate(tiny_args(2, "1f1b", 2, 6, "--pipeline-executor", "emulator",
                          "--manual-gc", "--manual-gc-interval", "2"))
    finally:
        gc.callbacks.remove(record)
    assert len(manual) == 3  # updates 1, 3 and 5 on two in-process stages: once each
    assert gc.isenabled() and gc.get_freeze_count() == 0


@pytest.mark.parametrize("flags", [["--manual-gc-interval", "2"], ["--no-manual-gc-eval"]])
def test_manual_gc_options_need_the_flag(flags: list[str], capsys) -> None:
    from megatron.trainer.plan.parse import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--mock-data", *flags])
    assert capsys.readouterr().err.strip() == "error: --manual-gc-interval/--no-manual-gc-eval need --manual-gc"
    parse_args(["--mock-data", "--manual-gc", *flags])
