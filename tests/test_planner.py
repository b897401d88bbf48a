"""The planner's pure core against hand-computed cases: FLOPs by pass, per-stage costs and
memory, the simulated iteration, ranking, the Pareto front and the JSON schema (issue 32)."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from megatron.pipeline.costs.cost_model import ModelShape, head_flops, layer_flops
from megatron.pipeline.planner.candidates import (
    Candidate, enumerate_candidates, micro_batch_sizes, offset_split)
from megatron.pipeline.costs.devices import Device, analytic_unit_costs, head_pass_flops, layer_pass_flops
from megatron.pipeline.planner.evaluate import CandidateResult, Problem, evaluate
from megatron.pipeline.costs.memory import StageMemory
from megatron.pipeline.planner.ranking import pareto_front, rank, split_by_semantics
from megatron.pipeline.planner.report import CANDIDATE_FIELDS, plan_dict, table
from megatron.pipeline.costs.stages import Parallelism
from megatron.pipeline.costs.unit_costs import ActivationBytes, PassCosts, UnitCosts, from_two_stage_profile
from megatron.pipeline.schedules import SCHEDULES
from tests.schedule_options import options_for

# h=4, one head (d=4), ffn 16, seq 2, micro-batch 1, vocab 8, fp32, no position table
TINY = ModelShape(num_layers=4, hidden=4, ffn=16, heads=1, query_groups=1, kv_channels=4, seq_length=2,
                  micro_batch=1, vocab=8)
UNIT = UnitCosts(micro_batch=1, layer=PassCosts(1.0, 1.0, 1.0))  # ms; no embedding, head, P2P or step


def test_pass_flops_by_hand_and_sum_to_the_cost_model():
    # per token: linears 2*4*12 + 2*4*16 + 2*16*4 + 2*4*4 = 384, attention 4*2*1*4 = 32; 2 tokens
    assert layer_pass_flops(TINY) == (2 * 416, 2 * (384 + 64), 2 * 384)
    assert sum(layer_pass_flops(TINY)) == layer_flops(TINY)
    assert sum(head_pass_flops(TINY)) == head_flops(TINY)


def test_analytic_costs_scale_with_the_datasheet():
    one = Device("unit", peak_tflops=1.0, achieved=1.0, hbm_gbs=1.0, intra_gbs=1.0, inter_gbs=1.0,
                 memory_gb=1.0, source="test")
    costs = analytic_unit_costs(TINY, one)
    assert costs.layer.f == pytest.approx(832 / 1e12 * 1e3, rel=1e-12)  # FLOPs / 1e12 FLOP/s, in ms
    assert costs.p2p == pytest.approx(2 * 4 * 4 / 1e9 * 1e3, rel=1e-12)  # s*b*h fp32 over 1 GB/s


def test_unit_costs_file_round_trip_and_micro_batch_scaling():
    costs = UnitCosts(2, PassCosts(1, 2, 3), head=PassCosts(4, 5, 6), p2p=0.5, source="x")
    assert UnitCosts.from_dict(json.loads(json.dumps(costs.to_dict()))) == costs
    assert costs.at_micro_batch(4).layer == PassCosts(2, 4, 6)
    with pytest.raises(ValueError, match="unknown cost field"):
        UnitCosts.from_dict({"micro_batch": 1, "layer": {"f": 1, "b": 1, "w": 1}, "t_f": 3})


def test_splits_and_micro_batch_sizes():
    assert offset_split(8, 4) == (1, 3, 3, 1)
    assert offset_split(8, 2) == (5, 3)
    assert offset_split(4, 4) is None  # one layer per stage leaves nothing to move
    assert micro_batch_sizes(16, 1) == [1, 2, 4, 8, 16]
    assert micro_batch_sizes(24, 2) == [1, 2, 4]


def _one_f_one_b(schedule: str = "1f1b", m: int = 4) -> Candidate:
    return Candidate(schedule, 2, 1, m, 1, "none", "even", (2, 2))


def test_one_f_one_b_iteration_and_memory_by_hand():
    # stage costs F = 2, BW = 4 (two layers of 1 ms each); 1F1B: (m + N - 1)(F + BW) = 5 * 6 = 30 ms
    result = evaluate(Problem(TINY, UNIT, global_batch=4), _one_f_one_b())
    assert result.iteration_time_ms == pytest.approx(30.0, rel=1e-12)
    assert result.tokens_per_s == pytest.approx(4 * 2 / 0.030, rel=1e-12)
    assert result.bubble_fraction == pytest.approx(1 - 24 / 30, rel=1e-12)
    # activations per layer per token: 5h + qkv 12 + mlp 2*16 + attention probs 2*1*2 = 68 elements;
    # 2 tokens, fp32: 544 B per layer. Stage 0 adds the embedding output (2*4*4 = 32 B) and holds
    # N = 2 micro-batches; stage 1 adds the fp32 logits and softmax (2*2*8*4 = 128 B), holds 1.
    assert [m.activations for m in result.memory] == [2 * (1088 + 32), 1 * (1088 + 128)]
    # parameters: layer 244, embedding 8*4 = 32, head 2*4 + 8*4 = 40; fp32: 4 + 4 + 8 B each
    assert [m.weights + m.gradients + m.optimizer for m in result.memory] == [520 * 16, 528 * 16]
    assert result.max_drift == [0, 0] and result.semantics == "exact"


def test_gpipe_holds_every_micro_batch():
    result = evaluate(Problem(TINY, UNIT, global_batch=4), _one_f_one_b("gpipe"))
    assert [m.activations for m in result.memory] == [4 * 1120, 4 * 1216]


def test_memory_fit_and_the_distributed_optimizer():
    need = 520 * 16 + 2240  # stage 0, the larger (previous test)
    assert not evaluate(Problem(TINY, UNIT, 4, device_bytes=need - 1), _one_f_one_b()).fits
    assert evaluate(Problem(TINY, UNIT, 4, device_bytes=need), _one_f_one_b()).fits
    sharded = evaluate(Problem(TINY, UNIT, 8, Parallelism(data_parallel=2, distributed_optimizer=True)),
                       _one_f_one_b())
    assert sharded.memory[0].optimizer == 520 * 8 / 2


def test_paci_drift_is_the_papers_bound():
    n, a = 4, 1
    cand = Candidate("paci", n, 1, a, 1, "none", "even", (1, 1, 1, 1))
    result = evaluate(Problem(TINY, UNIT, global_batch=1), cand)
    assert result.max_drift == [math.ceil((n - 1 - s) / a) for s in range(n)]  # PACI eq. 2
    assert result.semantics == "bounded-stale"


def test_every_registered_schedule_is_a_candidate():
    shape = ModelShape(8, 4, 16, 1, 1, 4, 2, 1, 8)
    found = {c.schedule for c, _ in enumerate_candidates(shape, [2], 16, 1) if c is not None}
    assert found == set(SCHEDULES)


def _fake(name: str, tps: float, mem: float, fits: bool = True, sem: str = "exact", m: int = 4) -> CandidateResult:
    cand = Candidate(name, 2, 1, m, 1, "none", "even", (2, 2))
    return CandidateResult(cand, 1.0, tps, 0.0, [StageMemory(mem * 1e9, 0, 0, 0)], fits, [0], sem)


def test_ranking_fits_first_by_throughput_ties_by_memory_and_apart_by_semantics():
    a, b, c = _fake("a", 10, 5), _fake("b", 20, 5), _fake("c", 30, 5, fits=False)
    d, e = _fake("d", 20, 4), _fake("e", 25, 9, sem="bounded-stale")
    ranked = rank([a, b, c, d, e])
    assert [r.candidate.schedule for r in ranked] == ["e", "d", "b", "a"]  # c does not fit; d ties b, less memory
    sync, asyn = split_by_semantics(ranked)
    assert [r.candidate.schedule for r in sync] == ["d", "b", "a"] and asyn == [e]


def test_pareto_front_by_hand():
    pts = {"A": (10, 1), "B": (20, 2), "C": (15, 2), "D": (18, 3), "E": (30, 4), "F": (20, 2)}
    front = pareto_front([_fake(k, tps, mem) for k, (tps, mem) in pts.items()])
    assert [r.candidate.schedule for r in front] == ["A", "B", "E"]  # C, D dominated; F equals B


def test_json_schema():
    problem = Problem(TINY, UNIT, global_batch=4, device_bytes=1e12)
    results = [evaluate(problem, _one_f_one_b(s)) for s in ("1f1b", "gpipe")]
    plan = json.loads(json.dumps(plan_dict(problem, results)))
    assert set(plan) >= {"model", "costs", "target", "synchronous", "asynchronous", "pareto", "candidates"}
    for cand in plan["candidates"]:
        assert set(CANDIDATE_FIELDS) <= set(cand)
        assert len(cand["peak_memory_gb"]) == len(cand["max_drift"]) == cand["pipeline_model_parallel_size"]
        assert cand["semantics"] in ("exact", "bounded-stale", "unbounded")
        assert cand["tied_embeddings"] == "tied"  # synchronous schedules tie (asynchronous: "untied: why")
        assert cand["flags"][:4] == ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", cand["schedule"]]
    assert plan["synchronous"] == [0, 1]  # equal time (a flush each), 1F1B needs less memory
    assert "1f1b" in table([results[0]], 4, "t")


def test_two_stage_profile_to_unit_costs_by_hand():
    # 2 layers per stage; stage 0 F = 2 * 3, stage 1 F = 2 * 3 + 5 (the head's 5)
    s0 = {"t_f": 6.0, "t_b": 8.0, "t_w": 4.0, "t_comm": 0.5}
    s1 = {"t_f": 11.0, "t_b": 15.0, "t_w": 7.0, "t_comm": 0.5}
    unit = from_two_stage_profile([s0, s1], (2, 2), micro_batch=2)
    assert unit.layer == PassCosts(3.0, 4.0, 2.0) and unit.head == PassCosts(5.0, 7.0, 3.0) and unit.p2p == 0.5


def test_cost_file_round_trip_with_host_cores_and_measured_activations():
    costs = UnitCosts(2, PassCosts(1, 2, 3), host_cores=2.0, activations=ActivationBytes(10.0, 1.0, 7.0),
                      kept_for_w=ActivationBytes(5.0, 0.0, 1.0))
    assert UnitCosts.from_dict(json.loads(json.dumps(costs.to_dict()))) == costs
    assert costs.at_micro_batch(4).activations == ActivationBytes(20.0, 2.0, 14.0)


def test_measured_activations_set_the_activation_unit():
    """A profile's per-micro-batch bytes replace the analytic count: 1F1B at N = 2 holds 2
    micro-batches on stage 0 (2 layers, the embedding) and 1 on stage 1 (2 layers, the head)."""
    unit = dataclasses.replace(UNIT, activations=ActivationBytes(layer=100.0, embedding=10.0, head=50.0))
    result = evaluate(Problem(TINY, unit, global_batch=4), _one_f_one_b())
    assert [m.activations for m in result.memory] == [2 * (2 * 100.0 + 10.0), 1 * (2 * 100.0 + 50.0)]
    kept = dataclasses.replace(unit, kept_for_w=ActivationBytes(layer=50.0, head=0.0))
    zb = evaluate(Problem(TINY, kept, global_batch=4), _one_f_one_b("zb-h1"))
    assert [c.m_w for c in zb.stage_costs] == [100.0 / 210.0, 100.0 / 250.0]  # kept / saved per part


def test_stages_sharing_cores_take_the_processor_sharing_time():
    """4 stages of 1F1B, m = 8, F = B = W = 1: a device each gives (m + N - 1) * 3 = 33; on 2
    cores all 4 * 8 * 3 = 96 units of work need at least 48; one core per stage is unchanged."""
    cand = Candidate("1f1b", 4, 1, 8, 1, "none", "even", (1, 1, 1, 1))
    own = evaluate(Problem(TINY, UNIT, global_batch=8), cand).iteration_time_ms
    assert own == pytest.approx(33.0)
    assert evaluate(Problem(TINY, UNIT, 8, host_cores=4), cand).iteration_time_ms == pytest.approx(own)
    shared = evaluate(Problem(TINY, UNIT, 8, host_cores=2), cand).iteration_time_ms
    assert 48.0 <= shared <= 48.0 + 3 * 3  # + at most the fill and drain of one op per hop
    by_file = evaluate(Problem(TINY, dataclasses.replace(UNIT, host_cores=2.0), 8), cand).iteration_time_ms
    assert by_file == shared


def test_transport_fields_round_trip_and_scale_with_the_micro_batch():
    costs = UnitCosts(2, PassCosts(1, 2, 3), p2p=0.25, message_cpu=1.5, reduce_ms_per_byte=2e-6, host_cores=2.0)
    assert UnitCosts.from_dict(json.loads(json.dumps(costs.to_dict()))) == costs
    # a retired field of earlier profiles is read and dropped; any other unknown one is refused
    assert UnitCosts.from_dict({**costs.to_dict(), "shared_core_slowdown": 1.08}) == costs
    with pytest.raises(ValueError, match="unknown cost field"):
        UnitCosts.from_dict({**costs.to_dict(), "shared_core_speedup": 1.0})
    doubled = costs.at_micro_batch(4)  # a message twice the bytes
    assert (doubled.p2p, doubled.message_cpu) == (0.5, 3.0)
    assert doubled.reduce_ms_per_byte == 2e-6


@pytest.mark.parametrize("cand", [Candidate("1f1b", 2, 1, 4, 1, "none", "even", (2, 2)),
                                  Candidate("interleaved-1f1b", 2, 1, 4, 2, "none", "even", (1, 1, 1, 1)),
                                  Candidate("zb-v", 2, 1, 4, 2, "none", "even", (1, 1, 1, 1))])
def test_message_cpu_is_every_stages_send_time(cand: Candidate):
    """The transport's CPU per message reaches the simulator as ``t_send`` on every stage, also
    where a stage hosts several parts (their mean once dropped it), and lengthens the iteration."""
    sending = dataclasses.replace(UNIT, message_cpu=0.5)
    plain = evaluate(Problem(TINY, UNIT, global_batch=4), cand)
    charged = evaluate(Problem(TINY, sending, global_batch=4), cand)
    assert [c.t_send for c in charged.stage_costs] == [0.5, 0.5]
    assert charged.iteration_time_ms > plain.iteration_time_ms


def test_amdp_window_update_costs_the_replica_all_gathers_each_device_sends():
    """AMDP at D = 4 (two pipelines): each device's step all-gathers the gradients and, sharded,
    the parameter ranges of both replicas it hosts. The bytes come from the comm-volume walk of
    the schedule's streams (an independent count), one input sent per all-gather of 2 ranks; the
    step covers half of each hosted replica's parameters."""
    from megatron.pipeline.comm_volume import CommShapes, step_comm_volume
    from megatron.pipeline.planner.evaluate import candidate_costs
    from megatron.pipeline.schedules import build_schedule

    unit = dataclasses.replace(UNIT, reduce_ms_per_byte=1e-3, optimizer_per_param=1e-2)
    cand = Candidate("amdp", 4, 1, 8, 1, "none", "even", (1, 1, 1, 1))
    problem = Problem(TINY, unit, global_batch=8)
    parts, _, costs = candidate_costs(problem, cand)
    schedule = build_schedule("amdp", cand.config(1))
    layout = schedule.layout
    chunk_params = {(s, c): int(parts[layout.model_stage(s, c)].params)
                    for s in range(4) for c in range(layout.num_chunks)}
    volume = step_comm_volume(schedule, CommShapes(1, 4, chunk_params))
    for device in range(4):
        sent = volume[device]["replica_grads"] + volume[device]["replica_params"]
        assert sent > 0 and costs[device].t_sync == pytest.approx(1e-3 * sent)
        hosted = sum(n for (s, _), n in chunk_params.items() if s == device)
        assert costs[device].t_opt == pytest.approx(hosted / 2 * 1e-2)
    priced = evaluate(problem, cand).iteration_time_ms
    assert priced > evaluate(Problem(TINY, UNIT, global_batch=8), cand).iteration_time_ms


def test_time_shared_stages_pay_the_messages_cpu_measured_there():
    """4 stages on 2 cores send at ``shared_message_cpu``; with a core each, at ``message_cpu``;
    a cost file without the shared measurement keeps ``message_cpu`` everywhere."""
    cand = Candidate("1f1b", 4, 1, 8, 1, "none", "even", (1, 1, 1, 1))
    unit = dataclasses.replace(UNIT, message_cpu=0.5, shared_message_cpu=1.5)
    assert {c.t_send for c in evaluate(Problem(TINY, unit, 8, host_cores=2), cand).stage_costs} == {1.5}
    assert {c.t_send for c in evaluate(Problem(TINY, unit, 8, host_cores=4), cand).stage_costs} == {0.5}
    unmeasured = dataclasses.replace(unit, shared_message_cpu=0.0)
    assert {c.t_send for c in evaluate(Problem(TINY, unmeasured, 8, host_cores=2), cand).stage_costs} == {0.5}


def _ops(schedule) -> list[list[tuple]]:
    return [[(op.kind, op.microbatch, op.chunk) for op in stream] for stream in schedule.streams()]


@pytest.mark.parametrize("name,profiles", [("zb-v", False), ("zb-1p", True), ("1f1b", True)])
def test_the_planner_orders_ops_as_its_flags_make_the_runtime_order_them(name: str, profiles: bool):
    """zb-v's flags do not profile, so the runtime orders it by the placeholder costs: the
    planner must simulate that order (timed with the real costs), not the order the real costs
    would give. zb-1p profiles first and orders by what it measured: the real costs. Reference:
    the schedule built from the schedule's own flag defaults, as ``run_config`` builds it."""
    from megatron.pipeline.planner.evaluate import candidate_costs, flag_order_costs, steady_span
    from megatron.pipeline.schedules import build_schedule, schedule_class

    head_heavy = dataclasses.replace(UNIT, head=PassCosts(6.0, 9.0, 0.0))
    problem = Problem(TINY, head_heavy, global_batch=8)
    chunks = 2 if name == "zb-v" else 1
    cand = Candidate(name, 2, 1, 8, chunks, "none", "even", (1,) * (2 * chunks))
    _, _, costs = candidate_costs(problem, cand)
    order = flag_order_costs(cand, costs, 1)
    assert (order == tuple(costs)) is profiles
    _, _, planned = steady_span(cand, costs, 1, order_costs=order)
    if profiles:
        return
    cls = schedule_class(name)
    defaults = {f.dest: f.default_value for g in cls.traits.flag_groups for f in g.flags}
    runtime = build_schedule(name, dataclasses.replace(cand.config(2),
                                                       options=cls.traits.options_from_flags(defaults, cand.config(2))))
    by_profile = build_schedule(name, cand.config(2, options_for(name, costs=tuple(costs))))
    assert _ops(planned) == _ops(runtime)
    assert _ops(by_profile) != _ops(runtime)  # the case can tell the two orders apart
