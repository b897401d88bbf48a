"""The balanced split of chunked layouts (:mod:`megatron.pipeline.costs.chunk_partition`):
exact against brute force over every split of small cases, and, at the peer harness's model and
at GPT-3 175B's shape, every rank's work in the timing simulator within one layer's of the mean."""
from __future__ import annotations

import itertools
import math

import pytest

from megatron.pipeline.costs.chunk_partition import ChunkPartition, Unit, partition_chunks
from megatron.pipeline.costs.cost_model import ModelShape, layer_flops, layer_units
from megatron.pipeline.costs.stages import Parallelism, part_costs, part_sizes, simulator_costs
from megatron.pipeline.costs.unit_costs import PassCosts, UnitCosts
from megatron.pipeline.ir import PipelineLayout, VShapeLayout
from megatron.pipeline.schedules import ScheduleConfig, ScheduleOptions, build_schedule
from megatron.pipeline.simulator import simulate_schedule


def v_owners(ranks: int) -> list[int]:
    layout = VShapeLayout(ranks)
    return [layout.physical(v)[0] for v in range(layout.num_virtual_stages)]


def interleaved_owners(ranks: int, chunks: int) -> list[int]:
    layout = PipelineLayout(ranks, chunks)
    return [layout.physical(v)[0] for v in range(layout.num_virtual_stages)]


def _compositions(total: int, parts: int):
    """Every way to write ``total`` as ``parts`` positive counts."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def _brute(num_layers: int, owners: list[int], layer: Unit, first: Unit, last: Unit, in_flight: list[float],
           budget: float) -> tuple[float, float]:
    """(least worst overshoot, least max rank time among splits with that overshoot), by summing
    per-layer vectors over every split: the problem as stated, not as the solver reduces it."""
    ranks = len(in_flight)
    per_layer = [[layer.time, layer.static, layer.activation] for _ in range(num_layers)]
    for k, (unit, index) in enumerate(((first, 0), (last, num_layers - 1))):
        per_layer[index] = [v + e for v, e in zip(per_layer[index], (unit.time, unit.static, unit.activation))]
    rows = []
    for counts in _compositions(num_layers, len(owners)):
        time, static, act, held = [0.0] * ranks, [0.0] * ranks, [0.0] * ranks, [0] * ranks
        start = 0
        for part, n in enumerate(counts):
            rank = owners[part]
            held[rank] += 1
            for t, s, a in per_layer[start:start + n]:
                time[rank] += t
                static[rank] += s
                act[rank] += a
            start += n
        over = max(max(0.0, static[r] + in_flight[r] * act[r] / held[r] - budget) for r in range(ranks))
        rows.append((over, max(time)))
    worst = min(o for o, _ in rows)
    return worst, min(t for o, t in rows if o <= worst * (1 + 1e-12))


CASES = [
    # (layers, owners, layer, first, last, in_flight, budget)
    (8, v_owners(2), Unit(1.0), Unit(0.01), Unit(2.5), [1.0, 1.0], math.inf),
    (9, v_owners(2), Unit(1.0), Unit(0.3), Unit(0.7), [1.0, 1.0], math.inf),
    (10, v_owners(3), Unit(1.0), Unit(0.0), Unit(4.2), [1.0, 1.0, 1.0], math.inf),
    (9, interleaved_owners(2, 2), Unit(1.0), Unit(0.2), Unit(3.1), [1.0, 1.0], math.inf),
    (11, interleaved_owners(3, 2), Unit(2.0), Unit(1.0), Unit(5.0), [1.0] * 3, math.inf),
    (8, interleaved_owners(2, 3), Unit(1.0), Unit(0.0), Unit(1.6), [1.0, 1.0], math.inf),
    # memory-bound: rank 0 holds more in flight, the budget takes layers from it
    (10, v_owners(2), Unit(1.0, 1.0, 1.0), Unit(0.1, 2.0, 0.5), Unit(2.0, 3.0, 2.0), [4.0, 2.0], 16.0),
    (10, v_owners(3), Unit(1.0, 2.0, 1.0), Unit(0.0, 1.0, 0.0), Unit(3.0, 1.0, 3.0), [6.0, 4.0, 2.0], 18.0),
    # nothing fits: least overshoot, then least time
    (8, v_owners(2), Unit(1.0, 1.0, 1.0), Unit(0.0, 5.0, 0.0), Unit(2.0, 5.0, 5.0), [4.0, 2.0], 6.0),
    (9, interleaved_owners(2, 2), Unit(1.0, 3.0, 1.0), Unit(0.0), Unit(2.0, 4.0, 4.0), [3.0, 2.0], 5.0),
]


def _evaluate(split: ChunkPartition, num_layers: int, layer: Unit, first: Unit, last: Unit) -> list[float]:
    """Rank times of the solver's counts, recomputed from the counts alone."""
    time = [0.0] * len(split.rank_time)
    for part, (n, rank) in enumerate(zip(split.counts, split.owners)):
        time[rank] += n * layer.time + (first.time if part == 0 else 0.0)
        time[rank] += last.time if part == len(split.counts) - 1 else 0.0
    return time


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_solver_matches_brute_force(case: tuple) -> None:
    layers, owners, layer, first, last, in_flight, budget = case
    split = partition_chunks(layers, owners, layer, first, last, in_flight, budget)
    assert sum(split.counts) == layers and min(split.counts) >= 1 and len(split.counts) == len(owners)
    worst, best = _brute(layers, owners, layer, first, last, in_flight, budget)
    assert split.feasible == (worst == 0.0)
    assert max(max(0.0, m - budget) for m in split.rank_memory) == pytest.approx(worst, abs=1e-9)
    assert split.max_time == pytest.approx(best, rel=1e-12)
    assert max(_evaluate(split, layers, layer, first, last)) == pytest.approx(best, rel=1e-12)


def test_memory_case_binds() -> None:
    """The budgeted cases must differ from the unbudgeted optimum (else they test nothing)."""
    layers, owners, layer, first, last, in_flight, budget = CASES[6]
    free = partition_chunks(layers, owners, layer, first, last, in_flight)
    bound = partition_chunks(layers, owners, layer, first, last, in_flight, budget)
    assert bound.feasible and bound.max_time > free.max_time


def test_parts_of_a_rank_are_even() -> None:
    """A V's rank 0 with the head (2.5 layers): its 3 layers go 2 to the embedding's part, 1 to the head's; rank 1's tie goes to the later part"""
    split = partition_chunks(8, v_owners(2), Unit(1.0), Unit(0.01), Unit(2.5), [1.0, 1.0])
    assert split.counts == (2, 2, 3, 1) and split.rank_layers == (3, 5)


def test_refusals() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        partition_chunks(3, v_owners(2), Unit(1.0), Unit(0.0), Unit(0.0), [1.0, 1.0])
    with pytest.raises(ValueError, match="must own"):
        partition_chunks(8, [0, 0, 0, 0], Unit(1.0), Unit(0.0), Unit(0.0), [1.0, 1.0])


PEER = ModelShape(num_layers=8, hidden=256, ffn=1024, heads=4, query_groups=4, kv_channels=64, seq_length=128,
                  micro_batch=4, vocab=8192)
GPT3 = ModelShape(num_layers=96, hidden=12288, ffn=4 * 12288, heads=96, query_groups=96, kv_channels=128,
                  seq_length=2048, micro_batch=1, vocab=50257, param_bytes=2, activation_bytes=2)


def _simulated_rank_work(shape: ModelShape, layout: PipelineLayout, counts: list[int], schedule: str,
                         microbatches: int) -> list[float]:
    """Every rank's busy time in the timing simulator, the parts priced from FLOPs (F, B and W a
    third each of a part's forward + backward), the stage costs as the planner builds them."""
    layer, first, last = layer_units(shape)
    unit = UnitCosts(micro_batch=shape.micro_batch, layer=PassCosts(*[layer.time / 3] * 3),
                     embedding=PassCosts(*[first.time / 3] * 3), head=PassCosts(*[last.time / 3] * 3))
    per_part = part_costs(shape, unit, part_sizes(shape, counts), Parallelism())
    costs = simulator_costs(layout, per_part)
    options = ScheduleOptions(costs=costs) if schedule == "zb-v" else ScheduleOptions()
    chunks = 1 if isinstance(layout, VShapeLayout) else layout.num_chunks  # a V's two are the schedule's own
    config = ScheduleConfig(layout.num_stages, microbatches, num_chunks=chunks, num_iterations=1, options=options)
    return simulate_schedule(build_schedule(schedule, config), costs).busy


@pytest.mark.parametrize("shape, ranks, layout_name, schedule", [
    (PEER, 2, "v", "zb-v"), (PEER, 2, "v", "dualpipev"), (PEER, 2, "interleaved", "interleaved-1f1b"),
    (GPT3, 8, "v", "zb-v"), (GPT3, 16, "v", "zb-v"), (GPT3, 8, "interleaved", "interleaved-1f1b"),
    (GPT3, 16, "interleaved", "interleaved-1f1b")],
    ids=["peer-zbv", "peer-dualpipev", "peer-interleaved", "gpt3-pp8-v", "gpt3-pp16-v", "gpt3-pp8-int",
         "gpt3-pp16-int"])
def test_rank_work_within_one_layer_of_the_mean(shape: ModelShape, ranks: int, layout_name: str,
                                                 schedule: str) -> None:
    layout = VShapeLayout(ranks) if layout_name == "v" else PipelineLayout(ranks, 2)
    owners = [layout.physical(v)[0] for v in range(layout.num_virtual_stages)]
    layer, first, last = layer_units(shape)
    split = partition_chunks(shape.num_layers, owners, layer, first, last, [1.0] * ranks)
    m = 2 * ranks
    busy = _simulated_rank_work(shape, layout, list(split.counts), schedule, m)
    mean = sum(busy) / len(busy)
    one_layer = m * layer_flops(shape)  # one layer's F + B + W over the m micro-batches
    assert max(busy) - mean <= one_layer * (1 + 1e-9), (split.counts, busy)
    even = [shape.num_layers // len(owners)] * len(owners)
    even_busy = _simulated_rank_work(shape, layout, even, schedule, m)
    assert max(busy) <= max(even_busy) * (1 + 1e-12)  # never worse than the even split
    if shape is PEER:  # the head is 2.5 layers here: the even split misses the bound, so the test can fail
        assert max(even_busy) - sum(even_busy) / ranks > one_layer


# ------------------------------------------------------------------------------ V orders per chunk
def _chunk_op_costs(shape: ModelShape, counts: list[int]) -> list:
    """Per V chunk (virtual-stage order) F/B/W from FLOPs, in units of one layer's third."""
    from megatron.pipeline.costs.op_costs import OpCosts

    layer, first, last = layer_units(shape)
    out = []
    for part, n in enumerate(counts):
        flops = n * layer.time + (first.time if part == 0 else 0.0) + (last.time if part == len(counts) - 1 else 0.0)
        third = flops / layer.time
        out.append(OpCosts(t_f=third, t_b=third, t_w=third))
    return out


def test_v_planner_prices_each_chunk() -> None:
    """The greedy V planner's clock charges every op its own chunk's costs: each stage's busy time
    is ``m`` times its two chunks' F + B + W, which the stage-mean costs would only match in sum;
    equal chunk costs give the per-stage plan exactly."""
    from megatron.pipeline.costs.op_costs import OpCosts
    from megatron.pipeline.schedules.v_shape.greedy import VGreedyPlanner, best_v_plan

    p, m = 2, 8
    counts = list(partition_chunks(8, v_owners(p), *layer_units(PEER), [1.0] * p).counts)
    chunks = _chunk_op_costs(PEER, counts)
    layout = VShapeLayout(p)
    means = [OpCosts(*(sum(getattr(chunks[layout.virtual(s, c)], f) for c in (0, 1)) / 2 for f in ("t_f", "t_b", "t_w")))
             for s in range(p)]
    planner = VGreedyPlanner(means, m, 2.0 * p, chunk_costs=chunks)
    planner.plan()
    for s in range(p):
        want = m * sum(chunks[layout.virtual(s, c)].t_f * 3 for c in (0, 1))
        assert planner.clock.busy[s] == pytest.approx(want)
    equal = [OpCosts(1.0, 1.0, 1.0)] * p
    assert best_v_plan(equal, m, 2.0 * p, [equal[0]] * (2 * p)) == best_v_plan(equal, m, 2.0 * p)


@pytest.mark.parametrize("m", [4, 8])
def test_zbv_with_chunk_costs_is_a_valid_schedule(m: int) -> None:
    """zb-v takes ``2p`` costs (one per V chunk): its order passes the schedule check."""
    from megatron.pipeline.schedule_check import check_schedule

    counts = list(partition_chunks(8, v_owners(2), *layer_units(PEER), [1.0, 1.0]).counts)
    schedule = build_schedule("zb-v", ScheduleConfig(2, m, num_iterations=2,
                                                     options=ScheduleOptions(costs=_chunk_op_costs(PEER, counts))))
    check_schedule(schedule)
    assert len(schedule.costs) == 2  # the stages' means, for the simulator and the start's report
