"""Tied embeddings under Zero Bubble's optimizer post-validation on a chain (#42 item 3).

The embedding (stage 0) and the output layer's copy (the last stage) sum their gradients in
TGRAD/TSUM ops placed right before each end's PSTEP
(megatron/pipeline/schedules/zero_bubble/tied_exchange.py). References, independent of that
code path: the same schedule without post-validation (its synchronous step sums the two ends
in a collective), bitwise wherever the arithmetic is the same (no stage rolls back in place),
and the one-stage tied model (one parameter) within the bounds tests/adam_bounds.py derives
from its own AdamW steps. The two ends must stay bitwise equal after every validation, also
when one of them rolled back a step the other never took.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron.pipeline.comm import MsgKind, op_recvs, op_sends, tied_ends
from megatron.pipeline.ir import OpKind, PipelineLayout
from megatron.pipeline.replay import ScheduleError
from megatron.pipeline.runtime.executors.core import OpCore
from megatron.pipeline.runtime.tied_embeddings import tied_parameters
from megatron.pipeline.schedule_check import RERUN_POLICIES, check_streams
from megatron.pipeline.schedules import SCHEDULES, schedule_class
from megatron.pipeline.schedules.zero_bubble.post_validation import ValidationOutcomes
from megatron.pipeline.schedules.zero_bubble.tied_exchange import with_tied_exchange
from tests.async_helpers import (
    assert_runtime_equals_emulator, assert_trains_like, emulate, emulated_reference, final_params, read_log,
    run_pretrain)
from tests.test_post_validation import pv_schedule
from tests.test_tied_embeddings import TIED, _argv, _assert_dp2_tied_like_reference

PV = "--enable-optimizer-post-validation"
COSTS = ("--zb-costs", "1,1,1,0")  # zb-2p ordered from given costs: every iteration post-validated


def _tied_streams(schedule) -> tuple[list, PipelineLayout]:
    """Every stage's stream with the exchange a tied model's runtime adds (run_streams)."""
    layout = schedule.layout
    return [with_tied_exchange(s, stage, layout) for stage, s in enumerate(schedule.streams())], layout


# ------------------------------------------------------------------------------ streams


@pytest.mark.parametrize("name, chunks", [("1f1b", 1), ("zb-h1", 1), ("zb-2p", 1), ("interleaved-1f1b", 2)])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_tied_exchange_streams_pass_the_schedule_check_under_every_rerun_pattern(name: str, chunks: int, n: int) -> None:
    """The exchange's messages follow from the ops; replayed with every stage's traffic (and
    the reruns' re-sent activations) they neither deadlock nor cross in a FIFO lane."""
    def check(m: int, policy, tied: bool) -> list[int]:
        schedule = pv_schedule(name, n, m, chunks=chunks)
        outcomes = schedule.policy.post_validation.outcomes = ValidationOutcomes()
        streams, layout = _tied_streams(schedule) if tied else (schedule.streams(), schedule.layout)
        return check_streams(streams, layout, outcomes=outcomes, rerun_policy=policy)

    for m in (n, 2 * n):
        for policy in RERUN_POLICIES.values():
            tied, plain = check(m, policy, True), check(m, policy, False)
            extra = [t - p for t, p in zip(tied, plain)]
            assert extra == [3] + [0] * (n - 2) + [6], extra  # TSUM on stage 0, TGRAD + TSUM on the last, per update


def test_each_end_sums_right_before_its_pstep_and_the_middle_stages_do_not() -> None:
    schedule = pv_schedule("zb-2p", 4, 8, iters=2, assume=False)
    streams, layout = _tied_streams(schedule)
    ops = [list(s) for s in streams]
    embedding, output = tied_ends(layout)
    assert (embedding, output) == (0, 3)
    for stage, stream in enumerate(ops):
        kinds = [op.kind for op in stream]
        tied = [i for i, k in enumerate(kinds) if k in (OpKind.TGRAD, OpKind.TSUM)]
        psteps = [i for i, k in enumerate(kinds) if k is OpKind.PSTEP]
        if stage == output:
            assert [kinds[i - 2:i + 1] for i in psteps] == [[OpKind.TGRAD, OpKind.TSUM, OpKind.PSTEP]] * 2
        elif stage == embedding:
            assert [kinds[i - 1:i + 1] for i in psteps] == [[OpKind.TSUM, OpKind.PSTEP]] * 2
        else:
            assert tied == []
    tgrad = next(op for op in ops[output] if op.kind is OpKind.TGRAD)
    (grad,) = op_sends(tgrad, layout)
    assert (grad.kind, grad.src_stage, grad.dst_stage) == (MsgKind.TIED_GRAD, 3, 0)
    tsum0 = next(op for op in ops[embedding] if op.kind is OpKind.TSUM)
    assert op_recvs(tsum0, layout) == [grad] and op_sends(tsum0, layout)[0].kind is MsgKind.TIED_SUM


def test_the_output_stage_waiting_for_the_sum_before_sending_its_gradient_deadlocks() -> None:
    """The check sees the order: TSUM before TGRAD on the output stage waits for a sum that needs
    the gradient it has not sent."""
    schedule = pv_schedule("1f1b", 2, 2, iters=1, assume=False)
    streams, layout = _tied_streams(schedule)
    out = list(streams[1])
    i = next(i for i, op in enumerate(out) if op.kind is OpKind.TGRAD)
    out[i], out[i + 1] = out[i + 1], out[i]
    with pytest.raises(ScheduleError, match="deadlock|waiting"):
        check_streams([list(streams[0]), out], layout)


def test_one_stage_holding_both_ends_gets_no_exchange() -> None:
    """PP = 1 and the V layout (stage 0 holds both ends): nothing to send."""
    v = pv_schedule("zb-v", 2, 4, assume=False)
    assert tied_ends(v.layout) == (0, 0)
    for stage, stream in enumerate(v.streams()):
        assert not any(op.kind in (OpKind.TGRAD, OpKind.TSUM) for op in with_tied_exchange(stream, stage, v.layout))
    assert tied_ends(PipelineLayout(1)) == (0, 0)


# ------------------------------------------------------------------------------ emulator


@pytest.fixture
def ends_checked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """After every VALIDATE of the emulator: all tied ends hold the same bits; returns the
    validations seen."""
    seen: list[int] = []
    execute = OpCore.execute

    def checked(self: OpCore, op, inputs, send) -> None:
        execute(self, op, inputs, send)
        if op.kind is OpKind.VALIDATE and op.stage == 0:  # the last to validate: both ends are final
            ends = [p for w in self.workers for p in tied_parameters(w.setup.chunks)]
            assert len(ends) == 2 and torch.equal(ends[0], ends[1]), f"ends differ after VALIDATE #{op.update}"
            seen.append(op.update)

    monkeypatch.setattr(OpCore, "execute", checked)
    return seen


def _costs(schedule: str) -> tuple[str, ...]:
    return COSTS if schedule == "zb-2p" else ()


def _pv_argv(pp: int, schedule: str, *more: str) -> list[str]:
    return [*_argv(pp, schedule, batch=8, iters=5), *_costs(schedule), "--pipeline-executor", "emulator", *more]


def _counters(workers) -> list[tuple[int, int, int]]:
    return [(w.post_validation.optimistic_steps, w.post_validation.rollbacks, w.post_validation.redos) for w in workers]


def _assert_bitwise(ours: dict[str, torch.Tensor], want: dict[str, torch.Tensor], context: str) -> None:
    assert ours.keys() == want.keys(), context
    for name in want:
        assert torch.equal(ours[name], want[name]), (context, name)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", ["zb-2p", "1f1b"])
def test_tied_post_validation_is_bitwise_the_synchronous_step_where_nothing_rolls_back_in_place(
        megatron_world1, ends_checked, schedule: str, pp: int) -> None:
    """No clipping (every optimistic step stands) and clipping before any stage steps (every
    stage redoes at VALIDATE): the same sum, norms and steps as the synchronous step, bit for
    bit; with the exact rollback also when stages step and roll back."""
    for clip, validated, expect in (("0", (), "stand"), ("0.05", (), "redo"),
                                    ("1.0", ("--optimizer-post-validation-exact",), None)):
        ends_checked.clear()
        flags = ("--clip-grad", clip)
        want = final_params(emulate(_pv_argv(pp, schedule, *flags)))
        workers = emulate(_pv_argv(pp, schedule, *flags, PV, *validated))
        assert ends_checked == list(range(5))
        counters = _counters(workers)
        if expect == "stand":
            assert counters == [(5, 0, 0)] * pp
        elif expect == "redo":
            assert counters == [(0, 0, 5)] * pp
        _assert_bitwise(final_params(workers), want, f"{schedule} PP={pp} clip {clip} {validated}")


@pytest.mark.parametrize("schedule", ["zb-2p", "1f1b"])
def test_an_end_rolled_back_in_place_comes_back_bitwise_and_the_run_trains_like_one_stage(
        megatron_world1, tmp_path: Path, ends_checked, schedule: str) -> None:
    """PP 4, --clip-grad 1.0: in some update stage 0 steps optimistically (its prefix is below
    the threshold) and the global norm is not, so stage 0 rolls back in place a step the last
    stage never took; the tied end comes back bitwise (the copies stay equal) and the run trains
    like the tied one-stage reference within the derived bounds."""
    ref = emulated_reference(_argv(1, "1f1b", batch=8, iters=5), tmp_path / "ref.jsonl")
    log = tmp_path / "pv.jsonl"
    workers = emulate(_pv_argv(4, schedule, "--clip-grad", "1.0", PV, "--log-json", str(log)))
    counters = _counters(workers)
    assert counters[0][1] > counters[-1][1], counters  # stage 0 rolled back more than the last stage stepped
    assert ends_checked == list(range(5))
    assert_trains_like(read_log(log), final_params(workers), ref, context=f"{schedule} PP=4 post-validated")


# ------------------------------------------------------------------------------ distributed


def test_distributed_runtime_sums_like_the_emulator(megatron_world1, tmp_path: Path) -> None:
    """PP 2 on gloo: the exchange travels its own lane between the two ranks; the same bits as
    the emulator, and each rank's end equal to the other's."""
    argv = [*_argv(2, "zb-2p", batch=8, iters=4), *COSTS, PV, "--clip-grad", "1.0"]
    records, _ = assert_runtime_equals_emulator(argv, tmp_path / "dist")
    stages = [torch.load(f) for f in sorted((tmp_path / "dist" / "params").glob("stage*.pt"))]
    assert torch.equal(stages[0][TIED], stages[-1][TIED])
    assert all(r["embeddings"]["tied"] for r in records)


@pytest.mark.slow
def test_distributed_runtime_at_pp4_sums_like_the_emulator(megatron_world1, tmp_path: Path) -> None:
    """PP 4 x DP 1: the exchange between ranks 0 and 3 (no link of the chain), with a rollback
    on stage 0 that the last stage never took."""
    argv = [*_argv(4, "zb-2p", batch=8, iters=5), *COSTS, PV, "--clip-grad", "1.0"]
    _, workers = assert_runtime_equals_emulator(argv, tmp_path / "dist")
    counters = _counters(workers)
    assert counters[0][1] > counters[-1][1], counters  # stage 0 rolled back a step the last never took
    stages = [torch.load(f) for f in sorted((tmp_path / "dist" / "params").glob("stage*.pt"))]
    assert torch.equal(stages[0][TIED], stages[-1][TIED])


@pytest.mark.slow
@pytest.mark.parametrize("flags", [(), ("--use-distributed-optimizer",), ("--overlap-grad-reduce",)],
                         ids=["all-reduce", "distributed-optimizer", "overlap"])
def test_pp2_dp2_post_validation_ties_and_trains_like_one_stage(megatron_world1, tmp_path: Path,
                                                                flags: tuple[str, ...]) -> None:
    """PP 2 x DP 2: each end averages over its replicas, then the two ends sum (the synchronous
    step's order; with the distributed optimizer the sum comes first, on the whole gradients,
    before the reduce-scatter); the ends stay bitwise equal, and banner and --log-json count the
    tied parameter once."""
    _assert_dp2_tied_like_reference(tmp_path, "zb-2p", PV, *COSTS, *flags)


# ------------------------------------------------------------------------------ configuration


def _config(schedule: str, pp: int, **flags) -> SimpleNamespace:
    """What :func:`~megatron.trainer.config.tied_args.embeddings_of` reads of a job config."""
    return SimpleNamespace(schedule=SimpleNamespace(pipeline_schedule=schedule, **flags),
                           parallel=SimpleNamespace(pipeline_model_parallel_size=pp),
                           model=SimpleNamespace(untie_embeddings_and_output_weights=False))


@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("post_validation", [False, True])
def test_no_synchronous_configuration_falls_back_to_untied(pp: int, post_validation: bool) -> None:
    """Every registered schedule: the synchronous ones tie (post-validated or not, any size, any
    data-parallel option), only the asynchronous ones (and auto-async, which may pick one) untie,
    and say why; the planner agrees."""
    from megatron.pipeline.planner.auto_schedule import AutoAsyncSchedule
    from megatron.pipeline.planner.evaluate import ASYNCHRONOUS_UNTIED, tied_embeddings
    from megatron.trainer.config.tied_args import embeddings_of

    assert SCHEDULES
    for name in SCHEDULES:
        for dp_flags in ({}, {"use_distributed_optimizer": True}, {"overlap_grad_reduce": True}):
            embeddings = embeddings_of(_config(name, pp, enable_optimizer_post_validation=post_validation, **dp_flags))
            cls = schedule_class(name)
            asynchronous = cls.traits.asynchronous or issubclass(cls, AutoAsyncSchedule)
            assert embeddings.tied is not asynchronous, (name, pp, post_validation, dp_flags, embeddings.line)
            if asynchronous:
                assert ASYNCHRONOUS_UNTIED in embeddings.line
            else:
                assert embeddings.line.startswith("embeddings: tied")
        problem = SimpleNamespace(tied=True, post_validation=post_validation)  # what the planner reads of a Problem
        assert (tied_embeddings(name, problem) == "tied") is not schedule_class(name).traits.asynchronous


@pytest.mark.slow
@pytest.mark.parametrize("flags", [(), ("--use-distributed-optimizer",)], ids=["all-reduce", "distributed-optimizer"])
def test_pp2_dp2_post_validation_without_clipping_is_bitwise_the_synchronous_step(
        megatron_world1, tmp_path: Path, flags: tuple[str, ...]) -> None:
    """No clipping: every optimistic step stands, and the exchange sums what the synchronous
    step's embedding group sums, in the same order relative to the data-parallel reduction."""
    from tests.test_tied_embeddings import _dp2

    argv = [*_dp2("zb-2p", *COSTS, *flags), "--clip-grad", "0"]
    _, want = run_pretrain(argv, tmp_path / "sync")
    records, ours = run_pretrain([*argv, PV], tmp_path / "pv")
    _assert_bitwise(ours, want, f"PP2 DP2 {flags}")
    stages = [torch.load(f) for f in sorted((tmp_path / "pv" / "params").glob("stage*.pt"))]
    assert torch.equal(stages[0][TIED], stages[-1][TIED]) and all(r["embeddings"]["tied"] for r in records)
