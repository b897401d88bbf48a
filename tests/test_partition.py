"""The memory-constrained min-max partition (megatron/pipeline/costs/partition.py, PACI App. D.5):
optimal against brute force over every split, the infeasibility fallback, and
``--pipeline-partition auto`` end to end in the emulator on a tiny GPT."""
from __future__ import annotations

import itertools
import math
import random

import pytest

from megatron.pipeline.costs.partition import one_f_one_b_in_flight, partition_layers


def _splits(num_layers: int, num_stages: int):
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = (0, *cuts, num_layers)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def _evaluate(counts, times, static, act, in_flight):
    start, t, mem = 0, [], []
    for j, c in enumerate(counts):
        layers = range(start, start + c)
        t.append(sum(times[l] for l in layers))
        mem.append(sum(static[l] for l in layers) + in_flight[j] * sum(act[l] for l in layers))
        start += c
    return max(t), mem


def _brute_force(times, static, act, in_flight, budget):
    """(max time, worst overshoot) lexicographic optimum over all splits, and whether it fits."""
    best = None
    for counts in _splits(len(times), len(in_flight)):
        t, mem = _evaluate(counts, times, static, act, in_flight)
        over = max(max(0.0, m - budget) for m in mem)
        key = (over, t)
        if best is None or key < best:
            best = key
    return best


def test_hand_checked_cases() -> None:
    # Equal layers: the even split.
    p = partition_layers([1.0] * 8, [0.0] * 8, [0.0] * 8, [1, 1, 1, 1])
    assert p.counts == (2, 2, 2, 2) and p.max_time == 2.0 and p.feasible
    # A heavy first layer (embedding) and last layer (head): they get fewer neighbours.
    p = partition_layers([3.0, 1, 1, 1, 1, 1, 1, 3.0], [0.0] * 8, [0.0] * 8, [1, 1, 1, 1])
    assert p.max_time == 3.0 and p.counts == (1, 3, 3, 1)
    # Memory: stage 0 holds 4 micro-batches (1F1B, N = 4), so with a budget it must take fewer layers.
    in_flight = one_f_one_b_in_flight(4, 8)
    assert in_flight == [4, 3, 2, 1]
    p = partition_layers([1.0] * 8, [1.0] * 8, [1.0] * 8, in_flight, budget=8.0)
    assert p.feasible and all(m <= 8.0 for m in p.stage_memory)
    assert p.counts[0] == 1 and p.max_time == 3.0  # 2 layers on stage 0 would need 2 + 4 * 2 = 10
    assert p.stage_memory == (5.0, 8.0, 6.0, 6.0) and p.counts == (1, 2, 2, 3)


@pytest.mark.parametrize("seed", range(30))
def test_optimal_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    num_layers, num_stages = rng.randint(2, 9), rng.randint(1, 4)
    num_stages = min(num_stages, num_layers)
    times = [rng.choice([0.5, 1.0, 1.5, 2.0, 3.0]) for _ in range(num_layers)]
    static = [rng.uniform(0, 2) for _ in range(num_layers)]
    act = [rng.uniform(0, 1) for _ in range(num_layers)]
    in_flight = one_f_one_b_in_flight(num_stages, rng.randint(1, 8))
    budget = rng.choice([math.inf, rng.uniform(1, 10), 0.5])
    p = partition_layers(times, static, act, in_flight, budget)
    over, t = _brute_force(times, static, act, in_flight, budget)
    assert len(p.counts) == num_stages and sum(p.counts) == num_layers and min(p.counts) >= 1
    t_p, mem = _evaluate(p.counts, times, static, act, in_flight)
    assert p.stage_memory == pytest.approx(mem) and p.max_time == pytest.approx(t_p)
    assert p.feasible == (over == 0.0)
    assert p.overshoot == pytest.approx(over, abs=1e-12)
    assert p.max_time == pytest.approx(t, abs=1e-12)


def test_infeasible_budget_falls_back_to_least_overshoot_then_least_time() -> None:
    # Nothing fits 1.0 (a layer alone needs 2). The fallback takes the split whose worst stage
    # overshoots least, (2, 2), although (3, 1) would be faster (max time 5 < 6).
    times = [1.0, 1.0, 1.0, 5.0]
    static = [2.0, 2.0, 2.0, 2.0]
    act = [0.0, 0.0, 0.0, 0.0]
    p = partition_layers(times, static, act, [1, 1], budget=1.0)
    assert not p.feasible
    assert p.overshoot == 3.0  # 2 layers per stage: 4 - 1; any other split puts 3 layers (6) on a stage
    assert p.counts == (2, 2) and p.max_time == 6.0
    # A feasible budget never reports a fallback.
    assert partition_layers(times, static, act, [1, 1], budget=100.0).feasible


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        partition_layers([1.0], [0.0], [0.0], [1, 1])
    with pytest.raises(ValueError):
        partition_layers([1.0, -1.0], [0.0, 0.0], [0.0, 0.0], [1])


def test_auto_partition_end_to_end_in_the_emulator(capsys: pytest.CaptureFixture[str]) -> None:
    """``--pipeline-partition auto`` profiles the tiny GPT, prints its choice and trains on it.

    The budget (0.001 GB) is below any split's memory, so this also runs the fallback path; the
    split printed is the one the stages are built with.
    """
    import re

    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.tasks.gpt import GPTTask
    from megatron.trainer.loop.training import emulate

    task = GPTTask()
    parser = build_parser("gpt")
    task.add_arguments(parser)
    config = parse_run_plan([
        "--pipeline-executor", "emulator", "--pipeline-model-parallel-size", "2", "--num-layers", "5",
        "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8", "--vocab-size", "64",
        "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1", "--log-interval", "1",
        "--device", "cpu", "--num-threads", "1", "--pipeline-partition", "auto",
        "--pipeline-partition-memory-gb", "0.00001", "--pipeline-partition-profile-iters", "1",
    ], parser)
    workers = emulate(task, config)
    out = capsys.readouterr().out
    split = [int(c) for c in re.search(r"layer split \[([0-9, ]+)\]", out).group(1).split(",")]
    assert sum(split) == 5 and min(split) >= 1 and "WARNING no split fits the budget" in out, out
    assert [len(w.setup.chunks[0].layers) for w in workers] == split
    assert all(w.setup.optimizer.step_count == 1 for w in workers)  # it trained on that split
