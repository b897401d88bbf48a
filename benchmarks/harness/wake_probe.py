"""The tiny-linear probe of what CPU work costs right after a sleep (this host's wake-up cost).

Shared by ``benchmarks/schedule_efficiency.py`` (it reads a schedule's overhead per op against
the probe) and the investigation that studies it, ``benchmarks/investigations/wake_cost.py``.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from megatron.trainer.tasks.synthetic import sleep_until

SHAPE = (8, 1, 16)  # the synthetic stages' default activation [s, b, h]


def tiny_linear_step() -> Callable[[], None]:
    """One forward and backward of a 16-wide linear on a ``SHAPE`` input (the synthetic stage's work)."""
    linear = torch.nn.Linear(SHAPE[-1], SHAPE[-1])
    x = torch.randn(SHAPE, requires_grad=True)

    def step() -> None:
        y = linear(x).clone()
        (y * y).mean().backward()

    return step


def time_after_sleep(work: Callable[[], None], sleep_s: float, repeats: int) -> float:
    """Median microseconds of ``work()`` run right after sleeping ``sleep_s`` (0: back to back)."""
    for _ in range(10):
        work()
    times = []
    for _ in range(repeats):
        if sleep_s > 0:
            sleep_until(time.perf_counter() + sleep_s)
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def linear_costs(sleeps_s: list[float], repeats: int) -> list[float]:
    """The tiny linear F+B after each sleep of ``sleeps_s`` (0 first: warm), in this process."""
    torch.set_num_threads(1)
    step = tiny_linear_step()
    return [time_after_sleep(step, s, repeats) for s in sleeps_s]
