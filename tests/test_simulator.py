"""The timing simulator: Zero Bubble's Table 5 from Table 6's profiled times, closed forms of
1F1B / GPipe / PACI, the paper's reference timelines, memory and drift accounting, capped
unbounded streams, cost profiles, and the ``tools/simulate_schedule.py`` CLI.
"""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

from megatron.pipeline.ir import BW, F, OPT, OpKind, PipelineLayout
from megatron.pipeline.replay import ScheduleError
from megatron.pipeline.schedules import ScheduleConfig, build_schedule
from megatron.pipeline.simulator import (
    OpCosts,
    cap_stream,
    costs_from_profile,
    simulate_schedule,
    simulate_streams,
    stage_costs,
)
from tests.schedule_options import options_for

REPO = Path(__file__).resolve().parents[1]


def simulate(name: str, n: int, m: int, costs: OpCosts | None = None, iterations: int = 1, **options):
    config = ScheduleConfig(n, m, num_iterations=iterations, options=options_for(name, costs=costs, **options))
    return simulate_schedule(build_schedule(name, config))


# ------------------------------------------------------------------ Zero Bubble Table 5

# (model, p, m, Table 6: T_F, T_B, T_W, T_comm, Table 5: 1F1B, ZB-H1, ZB-H2, ZB-1p, ZB-2p)
TABLE_5_6 = [
    ("1.5B", 8, 24, 18.522, 18.086, 9.337, 0.601, 0.2431, 0.1585, 0.1083, 0.1585, 0.0433),
    ("1.5B", 8, 32, 18.513, 18.086, 9.331, 0.626, 0.1985, 0.1242, 0.0837, 0.1242, 0.0039),
    ("1.5B", 8, 64, 18.546, 18.097, 9.321, 0.762, 0.1240, 0.0674, 0.0444, 0.0674, 0.0026),
    ("6.2B", 8, 24, 29.718, 29.444, 19.927, 0.527, 0.2347, 0.1323, 0.0698, 0.1323, 0.0029),
    ("6.2B", 8, 32, 29.802, 29.428, 19.530, 0.577, 0.1898, 0.1045, 0.0559, 0.1045, 0.0022),
    ("6.2B", 8, 64, 29.935, 29.621, 19.388, 0.535, 0.1091, 0.0554, 0.0294, 0.0554, 0.0010),
    ("14.6B", 16, 48, 11.347, 11.248, 8.132, 0.377, 0.2552, 0.1397, 0.0672, 0.1397, 0.0066),
    ("14.6B", 16, 64, 11.307, 11.254, 8.101, 0.379, 0.2082, 0.1088, 0.0516, 0.1088, 0.0054),
    ("14.6B", 16, 128, 11.325, 11.308, 8.109, 0.378, 0.1251, 0.0576, 0.0266, 0.0576, 0.0028),
    ("28.3B", 32, 96, 10.419, 10.207, 7.715, 0.408, 0.2646, 0.1421, 0.0641, 0.1421, 0.0038),
    ("28.3B", 32, 128, 10.408, 10.204, 7.703, 0.408, 0.2168, 0.1106, 0.0490, 0.1106, 0.0029),
    ("28.3B", 32, 256, 10.402, 10.248, 7.698, 0.460, 0.1352, 0.0594, 0.0257, 0.0594, 0.0018),
]
TABLE_5_SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "zb-1p", "zb-2p")


@pytest.mark.parametrize("row", TABLE_5_6, ids=lambda r: f"{r[0]}-m{r[2]}")
def test_table5_bubble_rates_from_table6_times(row) -> None:
    _, p, m, t_f, t_b, t_w, t_comm, *expected = row
    costs = OpCosts(t_f, t_b, t_w, t_comm=t_comm)
    got = [round(simulate(name, p, m, costs).bubble_rate, 4) for name in TABLE_5_SCHEDULES]
    assert got == pytest.approx(expected, abs=1e-12), dict(zip(TABLE_5_SCHEDULES, got))


# ------------------------------------------------------------------ closed forms

COST_CASES = [(1.0, 1.0, 1.0), (2.0, 1.0, 1.0), (1.0, 3.0, 0.5), (1.5, 0.7, 0.2), (0.3, 2.0, 2.0)]


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("t_f,t_b,t_w", COST_CASES)
def test_flush_schedules_take_m_plus_n_minus_1_slots(name: str, t_f: float, t_b: float, t_w: float) -> None:
    costs = OpCosts(t_f, t_b, t_w)
    for n in range(1, 7):
        for m in range(1, 2 * n + 2):
            r = simulate(name, n, m, costs)
            assert r.makespan == pytest.approx((m + n - 1) * (t_f + t_b + t_w)), (n, m)
            assert r.busy == pytest.approx([m * (t_f + t_b + t_w)] * n)
            # 1F1B and GPipe: stage 0 starts first and ends last, so its span is the cost.
            assert r.cost == pytest.approx(r.makespan)
            assert r.bubble_rate == pytest.approx((n - 1) / (m + n - 1))


def test_fused_backward_time_and_per_stage_costs() -> None:
    # t_bw overrides t_b + t_w.
    r = simulate("1f1b", 3, 5, OpCosts(1.0, 1.0, 1.0, t_bw=4.0))
    assert r.makespan == pytest.approx((5 + 2) * 5.0)
    # Per-stage costs: a slow last stage dominates; t_comm is charged to the sender.
    costs = [OpCosts(1, 1, 1, t_comm=0.5), OpCosts(3, 3, 3, t_comm=0.25)]
    r = simulate_streams(build_schedule("gpipe", ScheduleConfig(2, 2)).streams(), PipelineLayout(2), costs)
    f_starts = [sp.start for sp in r.spans[1] if sp.op.kind is OpKind.F]
    assert f_starts == [1.5, 4.5]  # F0 of stage 0 ends at 1, arrives at 1.5; stage 1 then busy
    assert r.busy == [2 * 3.0, 2 * 9.0]
    # Stage 1's BW0 ends at 7.5 + 6 = 13.5, its gradient reaches stage 0 at 13.75.
    bw0 = next(sp for sp in r.spans[0] if sp.op.kind is OpKind.BW)
    assert bw0.start == pytest.approx(13.75)


def test_synchronous_steps_across_iterations() -> None:
    n, m, t_opt = 4, 6, 0.5
    r = simulate("1f1b", n, m, OpCosts(1.0, 1.0, 1.0, t_opt=t_opt), iterations=3)
    per_iteration = (m + n - 1) * 3.0 + t_opt
    assert r.makespan == pytest.approx(3 * per_iteration)
    # Every stage leaves each collective at the same time.
    opt_ends = [[sp.end for sp in spans if sp.op.kind is OpKind.OPT] for spans in r.spans]
    assert all(ends == opt_ends[0] for ends in opt_ends)
    assert opt_ends[0] == pytest.approx([per_iteration * (i + 1) for i in range(3)])
    # The wait before the final step is not part of a stage's span; earlier waits are.
    last = r.spans[n - 1]
    assert r.stage_span[n - 1] == pytest.approx(last[-2].end + t_opt - last[0].start)
    assert r.stage_span[0] == pytest.approx(r.makespan)
    assert r.max_drift == [0] * n


@pytest.mark.parametrize("a", [1, 2, 3])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_paci_has_no_steady_state_bubble_and_bounded_drift(n: int, a: int) -> None:
    t_f, t_bw, updates = 1.0, 2.5, 6
    costs = OpCosts(t_f, 1.0, 1.0, t_bw=t_bw)
    name = "async-1f1b" if a == 1 else "paci"
    r = simulate(name, n, a, costs, iterations=updates)
    total = a * updates
    # Fill and drain once for the whole run: (M + N - 1) slots of T_F + T_BW.
    assert r.makespan == pytest.approx((total + n - 1) * (t_f + t_bw))
    for s in range(n):
        compute = [sp for sp in r.spans[s] if sp.op.kind is not OpKind.OPT]
        first_bw = next(i for i, sp in enumerate(compute) if sp.op.kind is OpKind.BW)
        last_f = max(i for i, sp in enumerate(compute) if sp.op.kind is OpKind.F)
        steady = compute[first_bw : last_f + 1]
        assert all(b.start == pytest.approx(a_.end) for a_, b in zip(steady, steady[1:])), s
        # Drift: ceil((N - 1 - s) / a) steps between a micro-batch's F and its BW, reached.
        assert r.max_drift[s] == math.ceil((n - 1 - s) / a)
        assert r.peak_memory[s] == n - s
        assert sum(1 for sp in r.spans[s] if sp.op.kind is OpKind.OPT) == updates


def test_unbounded_stream_with_a_micro_batch_cap() -> None:
    n, a, updates = 4, 2, 5
    costs = OpCosts(1.0, 1.0, 1.0, t_comm=0.1)
    finite = simulate("paci", n, a, costs, iterations=updates)
    endless = build_schedule("paci", ScheduleConfig(n, a, num_iterations=None))
    with pytest.raises(ValueError, match="max_microbatches"):
        simulate_schedule(endless, costs)
    capped = simulate_schedule(endless, costs, max_microbatches=a * updates)
    assert capped.spans == finite.spans
    assert capped.drift == finite.drift
    # A cap that is not a multiple of a: the last window's step is not reached.
    partial = simulate_schedule(endless, costs, max_microbatches=a * updates - 1)
    assert [sum(sp.op.kind is OpKind.OPT for sp in s) for s in partial.spans] == [updates - 1] * n
    with pytest.raises(ScheduleError, match="max_ops"):
        simulate_schedule(endless, costs, max_microbatches=100, max_ops=50)


def test_cap_stream_keeps_trailing_steps_only() -> None:
    stream = [F(0, 0), BW(0, 0), OPT(0, 0, False), F(0, 1), BW(0, 1), OPT(0, 1, False), F(0, 2)]
    assert list(cap_stream(iter(stream), 1)) == stream[:3]
    assert list(cap_stream(iter(stream), 2)) == stream[:6]


# ------------------------------------------------------------------ reference timelines

# Zero Bubble spec §2.5: p = 4, m = 8, T_F = T_B = T_W = 1, T_comm = 0 (1F1B's fused B is 2 units).
TIMELINES = {
    "1f1b": """
F1 F2 F3 F4 .  .  .  .  .  .  B1 B1 F5 B2 B2 F6 B3 B3 F7 B4 B4 F8 B5 B5 .  B6 B6 .  B7 B7 .  B8 B8
.  F1 F2 F3 .  .  .  .  B1 B1 F4 B2 B2 F5 B3 B3 F6 B4 B4 F7 B5 B5 F8 B6 B6 .  B7 B7 .  B8 B8 .  .
.  .  F1 F2 .  .  B1 B1 F3 B2 B2 F4 B3 B3 F5 B4 B4 F6 B5 B5 F7 B6 B6 F8 B7 B7 .  B8 B8 .  .  .  .
.  .  .  F1 B1 B1 F2 B2 B2 F3 B3 B3 F4 B4 B4 F5 B5 B5 F6 B6 B6 F7 B7 B7 F8 B8 B8 .  .  .  .  .  .
""",
    "zb-h1": """
F1 F2 F3 F4 .  .  .  B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 F8 B5 W5 B6 W6 B7 W7 B8 W8
.  F1 F2 F3 .  .  B1 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 F8 B6 W5 B7 W6 B8 W7 W8
.  .  F1 F2 .  B1 F3 B2 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 F8 B7 W5 B8 W6 W7 W8
.  .  .  F1 B1 F2 B2 F3 B3 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 F8 B8 W5 W6 W7 W8
""",
    "zb-h2": """
F1 F2 F3 F4 F5 F6 F7 B1 W1 F8 B2 W2 B3 W3 B4 W4 B5 W5 B6 W6 B7 W7 B8 W8 .  .  .
.  F1 F2 F3 F4 F5 B1 F6 B2 F7 B3 W1 F8 B4 W2 B5 W3 B6 W4 B7 W5 B8 W6 W7 W8 .  .
.  .  F1 F2 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 W1 F8 B6 W2 B7 W3 B8 W4 W5 W6 W7 W8 .
.  .  .  F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 W1 F8 B8 W2 W3 W4 W5 W6 W7 W8
""",
}


def render(result, width: int) -> list[list[str]]:
    """Unit-time cells per stage, 1-based micro-batches, as in the spec."""
    rows = []
    for spans in result.spans:
        cells = ["."] * width
        for sp in spans:
            if sp.op.kind is OpKind.OPT:
                continue
            label = ("B" if sp.op.kind is OpKind.BW else sp.op.kind.value) + str(sp.op.microbatch + 1)
            for t in range(int(sp.start), int(sp.end)):
                cells[t] = label
        rows.append(cells)
    return rows


@pytest.mark.parametrize("name", sorted(TIMELINES))
def test_reference_timelines(name: str) -> None:
    expected = [line.split() for line in TIMELINES[name].strip().splitlines()]
    result = simulate(name, 4, 8)
    assert result.makespan == len(expected[0])
    assert render(result, len(expected[0])) == expected


# ------------------------------------------------------------------ memory and costs


def test_activation_memory_of_flush_schedules() -> None:
    for n in range(1, 7):
        for m in range(1, 2 * n + 1):
            assert simulate("1f1b", n, m).peak_memory == [min(n - s, m) for s in range(n)]
            assert simulate("gpipe", n, m).peak_memory == [m] * n


def test_cost_profiles() -> None:
    profile = {"t_f": 2.0, "t_comm": 0.5, "stages": {"1": {"t_f": 3.0, "m_w": 0.25}}}
    costs = costs_from_profile(profile, 3)
    assert [c.t_f for c in costs] == [2.0, 3.0, 2.0]
    assert costs[1].m_w == 0.25 and costs[2].t_comm == 0.5 and costs[0].t_b == 1.0
    listed = costs_from_profile({"t_w": 0.5, "stages": [{}, {"t_b": 2}]}, 2)
    assert listed[1].t_b == 2.0 and listed[1].t_w == 0.5 and listed[1].fused_backward == 2.5
    assert stage_costs(None, 2) == (OpCosts(), OpCosts())
    with pytest.raises(ValueError, match="unknown cost field"):
        costs_from_profile({"tf": 1.0}, 2)
    with pytest.raises(ValueError, match="3 stages"):
        costs_from_profile({"stages": [{}, {}, {}]}, 2)
    with pytest.raises(ValueError, match="one OpCosts per stage"):
        stage_costs([OpCosts()], 2)
    with pytest.raises(ValueError, match="non-negative"):
        OpCosts(t_f=-1.0)


# ------------------------------------------------------------------ CLI


def _load_cli():
    spec = importlib.util.spec_from_file_location("simulate_schedule_cli", REPO / "tools" / "simulate_schedule.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cli():
    return _load_cli()


def test_cli_json(cli, capsys) -> None:
    rc = cli.main(["--schedule", "zb-2p", "--stages", "8", "--microbatches", "24", "--t-f", "18.522",
                   "--t-b", "18.086", "--t-w", "9.337", "--t-comm", "0.601", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert round(out["bubble_rate"], 4) == 0.0433
    assert out["memory_limit"] == 16.0
    assert len(out["stages"]) == 8 and max(s["peak_memory"] for s in out["stages"]) <= 16.0


def test_cli_takes_the_calibrated_runtime_terms(cli, capsys) -> None:
    """--t-send / --t-sync reach the simulator: the CLI's makespan is the library's with them."""
    def makespan(*flags: str) -> float:
        assert cli.main(["--schedule", "1f1b", "--stages", "4", "--microbatches", "4", "--iterations", "2",
                         "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)["makespan"]

    config = ScheduleConfig(num_stages=4, num_microbatches=4, num_iterations=2)
    expected = simulate_schedule(build_schedule("1f1b", config), OpCosts(t_send=0.25, t_sync=3.0)).makespan
    assert makespan("--t-send", "0.25", "--t-sync", "3") == pytest.approx(expected)
    assert expected > makespan() + 2 * 3.0  # each of the two synchronous steps pays t_sync


def test_cli_table_profile_and_async_drift(cli, capsys, tmp_path) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"t_f": 1.0, "t_b": 1.0, "t_w": 1.0, "stages": [{"t_f": 2.0}, {}, {}]}))
    rc = cli.main(["--schedule", "zb-h1", "--stages", "3", "--microbatches", "6", "--profile", str(profile),
                   "--t-comm", "0.1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "bubble rate" in out and "peak mem (M_B)" in out and "max drift" not in out
    rc = cli.main(["--schedule", "paci", "--stages", "4", "--microbatches", "2", "--iterations", "5", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["max_drift"] for s in out["stages"]] == [2, 1, 1, 0]
    rc = cli.main(["--schedule", "async-1f1b", "--stages", "3", "--microbatches", "1", "--iterations", "6"])
    assert rc == 0
    assert "max drift" in capsys.readouterr().out


def test_cli_errors_are_one_line(cli, capsys) -> None:
    rc = cli.main(["--schedule", "zb-1p", "--stages", "4", "--microbatches", "8", "--memory-limit", "0.5"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: zb-1p:") and err.count("\n") == 1


def test_cli_png(cli, capsys, tmp_path) -> None:
    png = tmp_path / "timeline.png"
    args = ["--schedule", "zb-h2", "--stages", "4", "--microbatches", "8", "--png", str(png)]
    if importlib.util.find_spec("matplotlib") is None:
        assert cli.main(args) == 2
        assert capsys.readouterr().err.strip() == cli.MATPLOTLIB_MISSING
    else:
        assert cli.main(args) == 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name,whole_stage_peak", [("zb-v", 4), ("v-half", 3), ("v-min", 2), ("dualpipev", 4.5)])
def test_cli_v_schedules_json_chunks_and_png(cli, capsys, tmp_path, name: str, whole_stage_peak: float) -> None:
    """The V names, a ``chunks`` field of 2 (the layout's, whatever --chunks says), so the
    paper's whole-stage peak is ``peak_memory / chunks`` (N = 4: 4, 3, 2; DualPipeV 2N + 1 chunk
    activations); the PNG marks chunk 1 (labels ``mb.1``)."""
    assert cli.main(["--schedule", name, "--stages", "4", "--microbatches", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chunks"] == 2
    assert max(s["peak_memory"] for s in out["stages"]) / out["chunks"] == whole_stage_peak
    assert cli.main(["--schedule", name, "--stages", "4", "--microbatches", "8"]) == 0
    assert f"{whole_stage_peak:.3f} whole-stage activations (2 chunks per stage)" in capsys.readouterr().out
    if importlib.util.find_spec("matplotlib") is not None:
        png = tmp_path / f"{name}.png"
        assert cli.main(["--schedule", name, "--stages", "4", "--microbatches", "8", "--png", str(png)]) == 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_png_without_matplotlib(cli, capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    png = tmp_path / "timeline.png"
    rc = cli.main(["--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--png", str(png)])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.strip() == cli.MATPLOTLIB_MISSING and err.count("\n") == 1
    assert not png.exists()


def test_a_post_validated_schedule_is_timed_without_an_executor() -> None:
    """No executor runs the VALIDATEs in a timing model: a VALIDATE nobody recorded keeps its
    update (the common case) instead of raising, which crashed ``auto`` pricing a post-validated
    relayout; a recorded re-run is kept, and the schedule's own outcomes are left alone."""
    config = ScheduleConfig(2, 4, num_iterations=3, options=options_for("zb-h1", post_validation=True))
    schedule = build_schedule("zb-h1", config)
    kept = simulate_schedule(schedule)
    outcomes = schedule.policy.post_validation.outcomes
    with pytest.raises(RuntimeError, match="read before it ran"):
        outcomes.rerun(0)  # the timed copy decided nothing for the schedule's own streams
    outcomes.record(0, True)
    rerun = simulate_schedule(schedule)
    assert math.isfinite(kept.makespan) and rerun.makespan > kept.makespan
