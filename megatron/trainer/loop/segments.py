"""The trainer's outer loop: training segments, with evaluation, checkpoints and exit between.

A run is cut into segments that end where something needs the whole pipeline still:
an evaluation (``--eval-interval``), a checkpoint (``--save-interval``, the run's end) or an
early exit (``--exit-interval``), or a stop check (``--exit-signal-handler``,
``--exit-duration-in-mins``: every rank agrees at a segment end whether to save and stop).
Each segment is the run's schedule restricted to its iterations (:meth:`Schedule.segment`), so every stream ends drained: asynchronous schedules
fill and drain once per segment, and nothing is in flight while evaluating or saving.

A segment boundary changes an asynchronous schedule's numbers (a drain is a flush), so
runs are only comparable bitwise with the same boundaries; a resumed run has the same
boundaries as the run that wrote the checkpoint, because the checkpoint ends a segment.

The executors differ (one process per stage, or all stages here), so the loop talks to a
:class:`SegmentRunner`.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Protocol

from megatron.pipeline.schedules.base import Schedule
from megatron.trainer.loop.logger import TrainingLogger


@dataclass(frozen=True)
class Segment:
    """Iterations ``[first, end)`` and what happens after them."""

    first: int
    end: int
    evaluate: bool = False  # validation split
    test: bool = False  # test split (the run's end only)
    save: bool = False
    exit: bool = False


def plan_segments(
    start: int,
    train_iters: int,
    eval_interval: int | None = None,
    save_interval: int | None = None,
    exit_interval: int | None = None,
    saving: bool = False,
    check_interval: int | None = None,
    boundaries: Collection[int] = (),
) -> list[Segment]:
    """Segments from ``start`` to ``train_iters`` (Megatron's semantics of the intervals).

    Evaluation after every multiple of ``eval_interval`` and at the end (then also on the
    test split); a checkpoint (when ``saving``) after every multiple of ``save_interval``, at
    an early exit and at the end; an exit after the first multiple of ``exit_interval``; a
    segment end (a stop check, nothing else) after every multiple of ``check_interval``.
    A segment also ends at every iteration of ``boundaries`` (a batch-size rampup's changes).
    """
    def due(interval: int | None, iteration: int) -> bool:
        return bool(interval) and iteration % interval == 0  # type: ignore[operator]

    segments: list[Segment] = []
    first = start
    for it in range(start + 1, train_iters + 1):
        end_of_run = it == train_iters
        stop = due(exit_interval, it) and not end_of_run
        if not (end_of_run or stop or due(eval_interval, it) or due(save_interval, it) or due(check_interval, it)
                or it in boundaries):
            continue
        segments.append(Segment(
            first, it,
            evaluate=eval_interval is not None and (due(eval_interval, it) or end_of_run),
            test=eval_interval is not None and end_of_run,
            save=saving and (due(save_interval, it) or stop or end_of_run),
            exit=stop,
        ))
        first = it
        if stop:
            break
    return segments


class SegmentRunner(Protocol):
    """One executor's way to train a segment, evaluate and save (emulator or runtime)."""

    def train(self, schedule: Schedule) -> None: ...

    def evaluate(self, split: str) -> tuple[float, int] | None:
        """Global (sum of token-weighted losses, tokens) of ``split``; None if it has no data."""

    def save(self, iteration: int) -> None: ...


def run_segments(
    schedule: Schedule,
    segments: list[Segment],
    runner: SegmentRunner,
    logger: TrainingLogger | None,
    say: Callable[[str], None] = print,
    stop: Callable[[int], str | None] | None = None,
    schedule_for: Callable[[int, int], Schedule] | None = None,
) -> Schedule | None:
    """Train ``segments`` in order; ``logger`` is None on ranks that do not log. Returns the
    last segment's schedule (what it decided while training), or None where the run stopped
    early (a stop reason, ``--exit-interval``).

    ``stop(iteration)`` is asked after every segment but the last (all ranks get the same
    answer); a reason stops the run there, after saving a checkpoint.
    ``schedule_for(first, count)`` gives a segment's schedule (default: ``schedule``
    restricted to it; a batch-size rampup builds one per accumulation).
    """
    current = schedule
    for seg in segments:
        current = (schedule_for or current.segment)(seg.first, seg.end - seg.first)
        runner.train(current)
        reason = stop(seg.end) if stop is not None and seg is not segments[-1] else None
        with logger.paused() if logger is not None else contextlib.nullcontext():
            for split, wanted in (("valid", seg.evaluate), ("test", seg.test)):
                if not wanted:
                    continue
                result = runner.evaluate(split)
                if result is None:
                    say(f"[megatron-async] no {split} data: skipping its evaluation")
                elif logger is not None:
                    logger.log_evaluation(seg.end, split, *result)
            if seg.save or reason:
                began = time.perf_counter()
                runner.save(seg.end)
                say(f"[megatron-async] saved checkpoint at iteration {seg.end} "
                    f"({time.perf_counter() - began:.1f} s)")
        if reason:
            say(f"[megatron-async] exiting after iteration {seg.end}: {reason}")
            return None
        if seg.exit:
            say(f"[megatron-async] exiting after iteration {seg.end} (--exit-interval)")
            return None
    return current
