"""``--pipeline-schedule auto`` / ``auto-async``: the choice against analytic optima, the switching
stream, the checkpointed decision, and training numbers equal to the chosen schedule's.

Analytic references (T_F = T_B = T_W = t, no communication, N stages, m >= N micro-batches):

* no synchronous order beats ``(N - 1) t + 3 m t``: the last stage cannot start before the
  first micro-batch's N - 1 forwards upstream, and then has 3 m t of work; ZB-H1 reaches it
  (its bubble ``(N - 1)(T_F + T_B - T_W)`` = ``(N - 1) t``), 1F1B takes ``(m + N - 1) 3t``;
* an asynchronous stream has no flush: its steady update takes ``3 m t`` (every stage busy).
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from megatron.pipeline.ir import OpKind
from megatron.pipeline.planner.runtime_choice import rank_choices, switchable
from megatron.pipeline.schedules import ScheduleConfig, ScheduleConfigError, build_schedule
from megatron.pipeline.costs.op_costs import OpCosts
from megatron.pipeline.simulator import simulate_schedule
from megatron.pipeline.schedule_check import check_schedule
from tests.async_helpers import TINY_GPT, emulate, final_params
from megatron.pipeline.planner.auto_schedule import AutoOptions, auto_options, register_auto_selectors
from megatron.pipeline.schedules.zero_bubble.flags import ZeroBubbleOptions

register_auto_selectors()  # auto, auto-async

N, M = 4, 8
EQUAL = (OpCosts(1.0, 1.0, 1.0, t_comm=0.0, m_w=1.0),) * N


def sync_optimum(n: int, m: int, t: float) -> float:
    return (n - 1) * t + 3 * m * t


def test_auto_reaches_the_synchronous_optimum_and_prefers_less_memory() -> None:
    ranked, _ = rank_choices(ScheduleConfig(N, M, 1), EQUAL, memory_limit=None)
    assert ranked[0].iteration_time == pytest.approx(sync_optimum(N, M, 1.0), rel=1e-12)
    by_name = {c.schedule: c for c in ranked}
    assert by_name["1f1b"].iteration_time == pytest.approx((M + N - 1) * 3.0, rel=1e-12)
    # ties at the optimum go to the least memory: ZB-H1 (N M_B) before ZB-H2 / ZB-2P (> N)
    assert ranked[0].schedule == "zb-h1" and max(ranked[0].peak) == N
    assert all(c.schedule in ("1f1b", "gpipe") or c.iteration_time == ranked[0].iteration_time for c in ranked)


def test_one_shared_core_makes_every_order_equal_and_the_least_memory_wins() -> None:
    """N stages on one core (no communication): the core never idles, so every synchronous order
    takes all the work, 3 N m t; the tie goes to the least peak memory (1F1B's N M_B on stage 0,
    ties with ZB-H1 broken by registry order: 1F1B first), not to ZB-H1's shorter critical path."""
    ranked, _ = rank_choices(ScheduleConfig(N, M, 1), EQUAL, memory_limit=None, cores=1)
    assert all(c.iteration_time == pytest.approx(3 * N * M, rel=1e-12) for c in ranked)
    assert ranked[0].schedule == "1f1b"
    config = ScheduleConfig(N, M, 1, options=AutoOptions(costs=EQUAL, host_cores=1))
    auto = build_schedule("auto", config)
    assert auto.choice["best"].iteration_time == pytest.approx(3 * N * M, rel=1e-12)


def test_memory_limit_excludes_and_async_only_with_auto_async() -> None:
    ranked, refused = rank_choices(ScheduleConfig(N, M, 1), EQUAL, memory_limit=N - 1)
    assert {c.schedule for c in ranked} <= {"zb-1p", "zb-2p"}  # the greedy fits any limit >= 1
    assert all(max(c.peak) <= N - 1 for c in ranked)
    assert any(r.startswith("1f1b: peak 4 M_B over the limit 3") for r in refused)
    assert all(not c.semantics.startswith("bounded") for c in rank_choices(ScheduleConfig(N, M, 1), EQUAL, None)[0])
    best = rank_choices(ScheduleConfig(N, M, 1), EQUAL, None, include_async=True)[0][0]
    assert best.schedule == "paci" and best.iteration_time == pytest.approx(3 * M, rel=1e-12)


def test_only_schedules_the_built_stages_can_run_are_candidates() -> None:
    config = ScheduleConfig(N, M, 1)
    assert switchable("zb-2p", config, False) and not switchable("paci", config, False)
    assert switchable("paci", config, True)
    for name in ("interleaved-1f1b", "zb-v", "amdp", "pipedream-2bw"):  # other layouts or worker state
        assert not switchable(name, config, True), name


def _iterations(ops):
    out, cur = [], []
    for op in ops:
        cur.append(op)
        if op.kind is OpKind.OPT:
            out.append(cur)
            cur = []
    return out


def test_profiled_auto_runs_zb_h1_then_the_choice_and_checkpoints_it() -> None:
    schedule = build_schedule("auto", ScheduleConfig(N, M, 4, options=ZeroBubbleOptions(profile_iters=2)))
    assert schedule.profiles_ops() and schedule.profile_end == 2
    schedule.set_costs((OpCosts(1.0, 1.0, 0.2, m_w=1.0),) * N)  # small W: ZB-H1's advantage shrinks
    check_schedule(schedule)
    chosen = schedule.target
    h1 = build_schedule("zb-h1", ScheduleConfig(N, M, 4))
    for s in range(N):
        ours = _iterations(schedule.stage_ops(s))
        assert ours[:2] == _iterations(h1.stage_ops(s))[:2]
        assert [op for op in ours[2] if op.kind is not OpKind.OPT] == list(chosen.iteration_ops(s, range(2 * M, 3 * M)))
    state = json.loads(json.dumps(schedule.checkpoint_state()))
    assert state["schedule"] == chosen.name and state["profile_end"] == 2
    resumed = build_schedule("auto", ScheduleConfig(N, M, 2, first_iteration=3, options=ZeroBubbleOptions(profile_iters=2)))
    resumed.restore_checkpoint_state({**state, "schedule": "1f1b"})  # the stored choice wins over a re-ranking
    assert resumed.target.name == "1f1b" and not resumed.profiles_ops() and resumed.profile_end == 2
    with pytest.raises(ScheduleConfigError, match="cannot run here"):
        build_schedule("auto", ScheduleConfig(N, M, 2, options=ZeroBubbleOptions(profile_iters=2))).restore_checkpoint_state(
            {**state, "schedule": "paci"})


def test_auto_async_switches_to_the_asynchronous_stream() -> None:
    schedule = build_schedule("auto-async", ScheduleConfig(N, M, 5, options=ZeroBubbleOptions(profile_iters=2)))
    schedule.set_costs(EQUAL)
    assert schedule.target.name == "paci"
    check_schedule(schedule)
    result = simulate_schedule(schedule, EQUAL)
    assert result.max_drift[0] > 0  # stale from iteration 2 on
    ops = list(schedule.stage_ops(0))
    assert [op.sync for op in ops if op.kind is OpKind.OPT] == [True, True, False, False, False]


# ------------------------------------------------------------------ end to end (emulator)

pytestmark = pytest.mark.usefixtures("megatron_world1")


def _gpt(schedule: str, *extra: str) -> list[str]:
    return [*TINY_GPT, "--num-layers", "4", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule,
            "--global-batch-size", "4", "--train-iters", "5", "--log-interval", "1", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--clip-grad", "1.0", "--device", "cpu", "--pipeline-executor", "emulator",
            *extra]


def _run(argv: list[str], log) -> tuple[list[float], dict[str, torch.Tensor]]:
    threads = torch.get_num_threads()
    try:
        workers = emulate([*argv, "--log-json", str(log)])
    finally:
        torch.set_num_threads(threads)
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()], final_params(workers)


def test_auto_trains_bitwise_like_the_chosen_schedule_from_the_start(tmp_path, capsys) -> None:
    """Every synchronous candidate computes 1F1B's numbers (module docstring of
    megatron/pipeline/planner/auto_schedule.py), so equality is exact, not within a bound."""
    losses, params = _run(_gpt("auto", "--zb-profile-iters", "2"), tmp_path / "auto.jsonl")
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "auto: chose " in ln)
    chosen = re.search(r"auto: chose (\S+) from iteration 2; order s0: ", line).group(1)
    assert "reason: fastest of" in line
    ref_losses, ref_params = _run(_gpt(chosen), tmp_path / "ref.jsonl")
    assert losses == ref_losses and len(losses) == 5
    for name, value in ref_params.items():
        assert torch.equal(value, params[name]), name


def test_auto_on_synthetic_stages_picks_the_analytic_best(capsys) -> None:
    """Sleep-timed stages with T_F = T_B = T_W = 8 ms under a limit of N M_B: the optimum class is
    ZB-H1's (module docstring: (N - 1) t + 3 m t = 216 ms at N = 4, m = 8; 1F1B 264 ms, 22 % slower);
    the chosen order, simulated with the true costs, must be within 5 % of the optimum (the
    issue's bar for auto), which profiling noise of a few percent on T_W cannot breach unless
    the choice were 1F1B- or GPipe-like."""
    from megatron.trainer.tasks.synthetic import SyntheticCostTask

    argv = ["--num-layers", str(N), "--pipeline-model-parallel-size", str(N), "--hidden-size", "8",
            "--seq-length", "4", "--micro-batch-size", "1", "--global-batch-size", str(M), "--train-iters", "3",
            "--pipeline-schedule", "auto", "--zb-profile-iters", "1", "--zb-memory-limit", str(N),
            "--synthetic-forward-ms", "8", "--synthetic-backward-ms", "8", "--synthetic-wgrad-ms", "8",
            "--num-threads", "1", "--log-interval", "1", "--pipeline-executor", "emulator", "--mock-data"]
    emulate(argv, SyntheticCostTask())
    logged = next(ln for ln in capsys.readouterr().out.splitlines() if "auto-schedule {" in ln)
    decision = json.loads(logged.split("auto-schedule ", 1)[1])
    chosen, profiled = decision["schedule"], tuple(OpCosts.from_dict(c) for c in decision["costs"])
    assert all(c.t_f == pytest.approx(8.0, rel=0.5) for c in profiled)  # the sleeps were measured
    true = (OpCosts(8.0, 8.0, 8.0, m_w=1.0),) * N
    # a greedy's order came from the profiled costs: rebuild it from them, time it with the true ones
    config = ScheduleConfig(N, M, 1, options=ZeroBubbleOptions(costs=profiled, memory_limit=float(N)))
    time = simulate_schedule(build_schedule(chosen, config), true).makespan
    assert time <= 1.05 * sync_optimum(N, M, 8.0), (chosen, time)


def test_auto_on_a_cpu_host_with_more_ranks_than_cores_gets_the_shared_cores(monkeypatch) -> None:
    """4 stages x 2 replicas on 4 cores: each pipeline's 4 stages share 4 * 4 / 8 = 2 cores; with
    a core per rank there is no sharing (None); a non-auto schedule is left alone."""
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.loop.auto.limits import apply_auto_host_cores, pipeline_cores

    def host_cores(argv: list[str]) -> float | None:
        """The cores apply_auto_host_cores gives the run (its config's option; None: left alone)."""
        config = parse_run_plan(argv)
        applied = apply_auto_host_cores(config)
        assert auto_options(config.run.schedule.options).host_cores is None  # the parsed config is not changed
        cores = auto_options(applied.run.schedule.options).host_cores
        assert (cores is None) == (applied is config)
        return cores

    assert pipeline_cores(4, 8, 4) == 2.0 and pipeline_cores(8, 8, 4) is None
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    flags = [*TINY_GPT, "--num-layers", "4", "--pipeline-model-parallel-size", "4", "--data-parallel-size", "2",
             "--global-batch-size", "16", "--mock-data", "--device", "cpu"]
    assert host_cores([*flags, "--pipeline-schedule", "auto"]) == 2.0
    assert host_cores([*flags, "--pipeline-schedule", "1f1b"]) is None
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert host_cores([*flags, "--pipeline-schedule", "auto"]) is None


def test_the_decision_says_what_its_costs_were_and_when_there_is_nothing_to_choose() -> None:
    """``--zb-profile-iters 0`` without ``--zb-costs`` ranks placeholder costs: the log used to
    say "fixed by --zb-costs", which the user never gave; at one stage every schedule ties (#42)."""
    def reason(n: int, **fields) -> str:
        auto = build_schedule("auto", ScheduleConfig(n, 4, num_iterations=3, options=AutoOptions(**fields)))
        first = auto.decision_lines()[0]
        assert first.startswith("auto: chose ")
        return first

    placeholder = reason(2, profile_iters=0)
    assert "placeholder F = B = W (--zb-profile-iters 0 and no --zb-costs: nothing measured" in placeholder
    assert "--zb-costs:" not in placeholder.replace("no --zb-costs:", "") and "one stage" not in placeholder
    given = reason(2, profile_iters=0, costs=(OpCosts(1.0, 2.0, 1.0), OpCosts(1.0, 2.0, 1.0)))
    assert "with costs fixed by --zb-costs" in given and "placeholder" not in given
    assert "one stage: no pipeline bubble to remove, every schedule takes the same time" in reason(1, profile_iters=0)
