"""The preflight replay (``megatron/pipeline/preflight.py``): every registered schedule passes
it, broken ones are refused with one line naming the stage and the op, a fault that only shows
after a segment boundary is found, and the work is bounded whatever ``--train-iters``.

The launch-level refusal (``pretrain()`` refuses a registered broken schedule before any rank
starts) is in ``tests/test_bad_inputs.py``; its broken schedules are defined here.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import pytest

from megatron.pipeline.ir import Op, OpKind
from megatron.pipeline.preflight import one_line, replay_first_iterations, segment_lengths
from megatron.pipeline.replay import ScheduleError
from megatron.pipeline.schedules import SCHEDULES, ScheduleConfig, build_schedule
from megatron.pipeline.schedules.sync.one_f_one_b import OneFOneBFlush
from megatron.pipeline.schedules.asynchronous.paci import PACI
from megatron.pipeline.schedule_check import check_schedule


class SwappedReceives(OneFOneBFlush):
    """1F1B whose last stage runs its first two forwards in the wrong order: it takes micro-batch
    1's activation first, but stage ``N - 2`` sends micro-batch 0's first (FIFO per lane)."""

    name = "broken-swapped-receives"

    def iteration_ops(self, stage: int, microbatches: range) -> Iterator[Op]:
        ops = list(super().iteration_ops(stage, microbatches))
        if stage == self.config.num_stages - 1:
            i, j = [k for k, op in enumerate(ops) if op.kind is OpKind.F][:2]
            ops[i], ops[j] = ops[j], ops[i]
        return iter(ops)


class OmittedSend(OneFOneBFlush):
    """1F1B whose stage 0 never runs an iteration's last micro-batch (so never sends its
    activation): stage 1 waits for it forever."""

    name = "broken-omitted-send"

    def iteration_ops(self, stage: int, microbatches: range) -> Iterator[Op]:
        ops = super().iteration_ops(stage, microbatches)
        return (op for op in ops if stage != 0 or op.microbatch != microbatches[-1])


class RestartsAtZero(PACI):
    """PACI whose streams ignore where a segment starts: right for a whole run, wrong after the
    first segment boundary (it re-runs micro-batch 0)."""

    name = "broken-restarts-at-zero"

    def segment_ops(self, stage: int, microbatches: Iterable[int]) -> Iterator[Op]:
        first = next(iter(microbatches), 0) if isinstance(microbatches, range) else 0
        shifted = (mb - first for mb in microbatches) if first else microbatches
        return super().segment_ops(stage, shifted)


def _config(cls: type, stages: int = 4, microbatches: int = 8, iterations: int = 100, **options) -> ScheduleConfig:
    return ScheduleConfig(stages, 1 if cls.name == "async-1f1b" else microbatches, iterations,
                          num_chunks=2 if cls.traits.takes_model_chunks else 1, options=cls.traits.options(**options))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_registered_schedule_passes(name: str) -> None:
    cls = SCHEDULES[name]
    replayed = replay_first_iterations(build_schedule(name, _config(cls)))
    assert replayed.first == 0 and len(replayed.lengths) == 2 and replayed.ops > 0


@pytest.mark.parametrize("options", [{"post_validation": True}, {"profile_iters": 2},
                                     {"profile_iters": 2, "post_validation": True}],
                         ids=["post-validation", "profiled", "profiled-post-validation"])
def test_post_validated_and_profiled_schedules_pass(options: dict) -> None:
    name = "zb-2p" if "profile_iters" in options else "1f1b"
    schedule = build_schedule(name, _config(SCHEDULES[name], **options))
    replayed = replay_first_iterations(schedule)
    assert replayed.lengths == ((3, 1) if "profile_iters" in options else (2, 1))
    assert not getattr(schedule, "decided", False), "the run's schedule keeps its own (profiled) decision"


@pytest.mark.parametrize("cls,says", [
    (SwappedReceives, "stage 3: F1@s3 expects"),
    (OmittedSend, "deadlock: stage 0: blocked at BW5@s0, waiting for grad(mb5)"),
])
def test_broken_schedules_are_refused_naming_stage_and_op(cls: type, says: str) -> None:
    with pytest.raises(ScheduleError) as exc:
        replay_first_iterations(cls(_config(cls)))
    assert says in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_a_fault_after_the_segment_boundary_is_found() -> None:
    """The whole run in one segment is fine; the trainer's second segment is not."""
    schedule = RestartsAtZero(_config(RestartsAtZero, iterations=4))
    check_schedule(schedule)
    with pytest.raises(ScheduleError, match="runs a forward twice"):
        replay_first_iterations(schedule)


def test_the_replay_is_bounded_by_stages_and_microbatches_not_iterations() -> None:
    short, long = (replay_first_iterations(build_schedule("1f1b", ScheduleConfig(8, 16, n)))
                   for n in (3, 10**9))
    assert short.ops == long.ops == 8 * (2 * 16 + 1) * 3  # F, BW per micro-batch, one OPT per iteration


@pytest.mark.parametrize("name,stages,microbatches,iterations,lengths", [
    ("1f1b", 4, 8, 100, (2, 1)),
    ("1f1b", 4, 8, 2, (2,)),
    ("1f1b", 4, 8, 1, (1,)),
    ("paci", 32, 4, 100, (9, 1)),  # ceil(32 / 4) + 1 updates fill the pipeline
    ("async-1f1b", 4, 1, 3, (3,)),
])
def test_segment_lengths(name: str, stages: int, microbatches: int, iterations: int, lengths: tuple) -> None:
    schedule = build_schedule(name, ScheduleConfig(stages, microbatches, iterations))
    assert segment_lengths(schedule, iterations) == lengths


def test_one_line_names_the_stage_blocked_on_a_receive() -> None:
    error = ScheduleError("deadlock:\n  stage 0: at OPT#0(sync)@s0, waiting for stages [0, 1] to reach it\n"
                          "  stage 1: blocked at F1@s1, waiting for act\n  stage 2: finished")
    assert one_line(error) == "deadlock: stage 1: blocked at F1@s1, waiting for act (2 of 3 stages cannot go on)"
