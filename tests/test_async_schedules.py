"""Asynchronous schedules (PACI, async-1F1B): stream structure, drift bound, equivalences."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from megatron.pipeline.ir import OpKind
from megatron.pipeline.schedules import ScheduleConfig, build_schedule
from megatron.pipeline.schedules.asynchronous.paci import drift_bound
from megatron.pipeline.schedule_check import check_schedule
from tests.async_helpers import emulate, final_params, tiny_args


@pytest.mark.parametrize("num_stages", range(1, 9))
def test_async_streams_pass_the_schedule_check_with_and_without_drains(num_stages):
    for a in range(1, 2 * num_stages + 1):
        for drain_every in (None, 1, 3):
            check_schedule(build_schedule("paci", ScheduleConfig(num_stages, a, 5, drain_every=drain_every)))


@pytest.mark.parametrize("num_stages,a", [(2, 1), (4, 1), (4, 2), (8, 3)])
def test_paci_admission_rule_holds_on_every_stage(num_stages, a):
    """q_i <= N - i (1-indexed) unresolved forwards whenever a new forward is admitted."""
    schedule = build_schedule("paci", ScheduleConfig(num_stages, a, None))
    for stage in range(num_stages):
        unresolved = 0
        peak_before_admission = 0
        for op in itertools.islice(schedule.stage_ops(stage), 500):
            if op.kind is OpKind.F:
                peak_before_admission = max(peak_before_admission, unresolved)
                unresolved += 1
            elif op.kind is OpKind.BW:
                unresolved -= 1
        assert peak_before_admission == num_stages - (stage + 1)


def test_unbounded_stream_steps_every_a_backwards():
    a = 3
    ops = list(itertools.islice(build_schedule("paci", ScheduleConfig(4, a, None)).stage_ops(1), 200))
    backwards = 0
    for op in ops:
        if op.kind is OpKind.BW:
            backwards += 1
        elif op.kind is OpKind.OPT:
            assert not op.sync and backwards == (op.update + 1) * a


def test_async_1f1b_rejects_accumulation_with_a_pointer_to_paci():
    from megatron.trainer.plan.parse import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(tiny_args(2, "async-1f1b", 2, 2))
    assert exc.value.code == 2


def _drift_histograms(num_stages, a, iters):
    workers = emulate(tiny_args(num_stages, "paci", a, iters, "--pipeline-executor", "emulator"))
    return [w.drift_histogram for w in workers]


@pytest.mark.parametrize(
    "num_stages,a", [(2, 1), (2, 2), (4, 1), (4, 2), (4, 3), (8, 1), (8, 2), (8, 4), (16, 3), (32, 8)]
)
def test_measured_drift_respects_and_reaches_the_paci_bound(megatron_world1, num_stages, a):
    """Depths beyond this machine (16, 32 stages) run in the emulator."""
    iters = (2 * num_stages) // a + 3  # long enough for the steady state on every stage
    for stage, hist in enumerate(_drift_histograms(num_stages, a, iters)):
        bound = drift_bound(num_stages, stage, a)
        assert bound == math.ceil((num_stages - (stage + 1)) / a)
        assert max(hist) == bound, (stage, dict(hist))


def test_paci_with_a_equal_1_is_async_1f1b(megatron_world1):
    args = tiny_args(4, "paci", 1, 6, "--pipeline-executor", "emulator")
    paci = emulate(args)
    naive = emulate([x if x != "paci" else "async-1f1b" for x in args])
    p, q = final_params(paci), final_params(naive)
    assert all(torch.equal(p[k], q[k]) for k in p)


def test_paci_on_one_stage_is_plain_gradient_accumulation(megatron_world1):
    """N=1: PACI's 1/a loss scaling makes it exactly 1F1B-flush's accumulation (itself checked
    against an independent non-pipelined loop in test_reference)."""
    args = tiny_args(1, "paci", 4, 5, "--pipeline-executor", "emulator")
    paci = final_params(emulate(args))
    flush = final_params(emulate([x if x != "paci" else "1f1b" for x in args]))
    assert all(torch.equal(paci[k], flush[k]) for k in paci)


def test_paci_keeps_the_activation_memory_of_1f1b(megatron_world1):
    """Peak in-flight micro-batches and saved-activation bytes per stage: PACI == 1F1B-flush."""
    args = tiny_args(4, "paci", 4, 4, "--pipeline-executor", "emulator", "--log-activation-memory")
    paci = emulate(args)
    flush = emulate([x if x != "paci" else "1f1b" for x in args])
    for p, f in zip(paci, flush):
        assert p.meter.run_peak_count == f.meter.run_peak_count == 4 - p.stage
        assert p.meter.run_peak_bytes == f.meter.run_peak_bytes > 0
