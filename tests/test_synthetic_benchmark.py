"""The synthetic-cost schedule-efficiency benchmark, in a tiny configuration.

Runs ``benchmarks/schedule_efficiency.py`` for 1F1B with N=2 stages, m=2 micro-batches and
5 iterations through the real distributed runtime (2 gloo processes), then checks that its
markdown table parses and that the measured time per iteration respects the sleeps: every
stage sleeps ``m * (t_f + t_b)`` per iteration, and 1F1B's dependency chain sleeps
``(m + N - 1) * (t_f + t_b)``, so a smaller measurement means the runtime skipped work. The
upper bound is generous: a loaded 2-core machine adds scheduling latency to every op.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "benchmarks" / "schedule_efficiency.py"

N, M, T_F, T_B = 2, 2, 10.0, 20.0


def _parse_markdown_table(text: str) -> list[dict[str, str]]:
    lines = [line for line in text.splitlines() if line.startswith("|")]
    assert len(lines) >= 3, f"no markdown table in the output:\n{text}"
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert set(lines[1].strip("|").split("|")) == {"---"}, lines[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert all(len(r) == len(header) for r in rows), rows
    return [dict(zip(header, r)) for r in rows]


@pytest.mark.slow
def test_schedule_efficiency_harness_tiny(tmp_path: Path) -> None:
    out_json = tmp_path / "result.json"
    cmd = [
        sys.executable, str(HARNESS),
        "--stages", str(N), "--microbatches", str(M), "--schedules", "1f1b",
        "--iterations", "5", "--log-interval", "1", "--warmup-intervals", "1",
        "--forward-ms", str(T_F), "--backward-ms", str(T_B), "--no-baseline",
        "--json", str(out_json), "--workdir", str(tmp_path / "logs"), "--run-timeout", "100",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    rows = _parse_markdown_table(proc.stdout)
    assert len(rows) == 1, rows
    row = rows[0]
    assert (row["schedule"], row["N"], row["m"]) == ("1f1b", str(N), str(M))
    ideal = M * (T_F + T_B)
    analytic = (M + N - 1) * (T_F + T_B)
    assert float(row["ideal m(tf+tb) ms"]) == pytest.approx(ideal)
    assert float(row["analytic ms"]) == pytest.approx(analytic)
    measured = float(row["measured ms"])
    assert measured >= ideal, f"measured {measured} ms < sleep floor {ideal} ms: work was skipped"
    assert measured >= 0.99 * analytic, f"measured {measured} ms beats 1F1B's critical path {analytic} ms"
    assert measured < 2 * analytic + 50, f"measured {measured} ms vs analytic {analytic} ms"
    assert float(row["analytic eff"]) == pytest.approx(M / (M + N - 1), abs=1e-3)
    assert float(row["measured eff"]) == pytest.approx(ideal / measured, abs=2e-3)
    assert "a tiny linear F+B takes" in proc.stdout, "the header lost the host's after-sleep cost"

    payload = json.loads(out_json.read_text())
    (result,) = payload["results"]
    assert result["error"] is None
    assert result["timed_iterations"] == 4  # iterations 2..5 (a median of 4: one stalled interval cannot set it)
    assert result["measured_ms"] == pytest.approx(measured, abs=0.05)
    assert payload["host_wake"] in proc.stdout


@pytest.mark.slow
def test_wake_cost_prints_warm_and_after_sleep_costs_of_both_probes() -> None:
    """``benchmarks/investigations/wake_cost.py`` (the host's after-sleep factor under the synthetic benchmarks):
    both probes run, across two processes for the gloo send, and each ratio column is its
    after-sleep median over the warm one."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "investigations" / "wake_cost.py"), "--sleep-ms", "1", "2", "--repeats", "5"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _parse_markdown_table(proc.stdout)
    assert [r["work"] for r in rows] == ["tiny linear F+B", "gloo isend, 512 B"], rows
    for row in rows:
        warm = float(row["warm us"])
        assert warm > 0
        for sleep in ("1", "2"):
            after = float(row[f"after {sleep} ms sleep us"])
            assert after > 0
            # The ratio is printed to 0.1 from unrounded medians (off by <= 0.05); warm and after
            # are printed to 0.1 us, each off by <= 0.05 us, which moves after / warm by up to
            # ratio * 0.05 * (1 / warm + 1 / after) (first order, plus a hair for the second).
            ratio = after / warm
            rounding = 0.05 + ratio * 0.05 * (1 / warm + 1 / after) * 1.01
            assert float(row[f"{sleep} ms / warm"].rstrip("x")) == pytest.approx(ratio, abs=rounding)


# --------------------------------------------------------------------------- B/W split sleeps


def _synthetic_worker(t_b: float, t_w: float):
    """A one-stage synthetic-cost worker built exactly as the trainer builds it."""
    import torch

    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.tasks.synthetic import SyntheticCostTask
    from megatron.trainer.loop.training import build_worker

    task = SyntheticCostTask()
    parser = build_parser("synthetic")
    task.add_arguments(parser)
    config = parse_run_plan([
        "--pipeline-model-parallel-size", "1", "--num-layers", "1", "--hidden-size", "8",
        "--num-attention-heads", "1", "--seq-length", "4", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--train-iters", "1", "--device", "cpu",
        "--synthetic-forward-ms", "0", "--synthetic-backward-ms", str(t_b), "--synthetic-wgrad-ms", str(t_w),
        "--log-activation-memory",
    ], parser)
    return build_worker(task, config, 0, 0, torch.device("cpu"), isolate_rng=True)


def test_synthetic_wgrad_sleep_lands_in_w_or_in_the_fused_backward() -> None:
    """T_W sleeps in op W under a B/W split and inside BW otherwise; B sleeps T_B only.

    Goes through the worker's own B / W / BW (weight-gradient deferral of the runtime), so the
    benchmark's ZB schedules are timed on the real code path. Costs are far apart (30 vs 150 ms)
    and the bounds one-sided or loose, so scheduler noise on a loaded host cannot flip them.
    """
    import time

    import torch

    from megatron.pipeline.ir import B, BW, F, W

    t_b, t_w = 30.0, 150.0
    worker = _synthetic_worker(t_b, t_w)

    def ms(fn) -> float:
        start = time.perf_counter()
        fn()
        return 1000.0 * (time.perf_counter() - start)

    worker.forward(F(0, 0), None)
    b = ms(lambda: worker.backward_input(B(0, 0), None))
    assert worker.meter.live_bytes((0, 0)) > 0, "B kept nothing for W: the weight gradient was not deferred"
    w = ms(lambda: worker.weight_grad(W(0, 0)))
    split_grads = [p.grad.clone() for p in worker.setup.optimizer.parameters()]
    worker.setup.optimizer.zero_grad()
    worker.forward(F(0, 0), None)
    bw = ms(lambda: worker.backward(BW(0, 0), None))
    fused_grads = [p.grad.clone() for p in worker.setup.optimizer.parameters()]

    assert t_b <= b < t_b + t_w / 2, f"B took {b:.1f} ms; expected T_B = {t_b} ms without T_W = {t_w} ms"
    assert w >= t_w, f"W took {w:.1f} ms < T_W = {t_w} ms"
    assert bw >= t_b + t_w, f"fused BW took {bw:.1f} ms < T_B + T_W = {t_b + t_w} ms"
    assert all(torch.equal(a, c) for a, c in zip(split_grads, fused_grads)), "B + W gradients differ from BW's"


def test_synthetic_sleep_ends_at_its_deadline_with_a_tight_timer_slack() -> None:
    """The benchmark model's sleeps: a forward's T_F counts from the forward's start (work before
    the sleep is inside T_F, not added to it), and on Linux the sleeping thread's timer slack is
    1 ns (the default 50 us slack let a sleep overshoot into the measured runtime cost)."""
    import sys
    import threading
    import time
    from pathlib import Path

    from megatron.trainer.tasks.synthetic import sleep_until

    def run() -> None:
        start = time.perf_counter()
        sleep_until(start - 1.0)  # a deadline in the past returns at once
        assert time.perf_counter() - start < 0.5
        sleep_until(start + 0.02)
        elapsed.append(time.perf_counter() - start)
        slack = Path("/proc/thread-self/timerslack_ns")
        slacks.append(int(slack.read_text()) if slack.exists() else None)

    elapsed: list[float] = []
    slacks: list[int | None] = []
    thread = threading.Thread(target=run)  # a thread of its own: the slack stays with it
    thread.start()
    thread.join()
    assert elapsed[0] >= 0.02, f"woke {1000 * (0.02 - elapsed[0]):.3f} ms before the deadline"
    if sys.platform.startswith("linux") and slacks[0] is not None:
        assert slacks[0] == 1, slacks


def test_synthetic_wgrad_defaults_to_zero() -> None:
    """Backwards compatible: without the flag a backward sleeps T_B only and W costs nothing."""
    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.tasks.synthetic import SyntheticCostTask

    parser = build_parser("synthetic")
    SyntheticCostTask().add_arguments(parser)
    args = parser.parse_args([])
    assert args.synthetic_wgrad_ms == 0.0 and args.synthetic_backward_ms == 40.0


# --------------------------------------------------------------------------- chunks per layout


def _synthetic_config(*argv: str):
    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.tasks.synthetic import SyntheticCostTask

    parser = build_parser("synthetic")
    SyntheticCostTask().add_arguments(parser)
    return parse_run_plan([
        "--hidden-size", "8", "--num-attention-heads", "1", "--seq-length", "4", "--micro-batch-size", "1",
        "--device", "cpu", "--num-threads", "1", "--log-interval", "1", "--lr-warmup-iters", "0",
        "--synthetic-forward-ms", "2", "--synthetic-backward-ms", "4", "--synthetic-wgrad-ms", "6", *argv,
    ], parser)


def test_synthetic_chunks_follow_the_layout_and_keep_the_per_stage_cost() -> None:
    """Chunks sit where the schedule's layout puts them; one micro-batch sleeps T_F / T_B / T_W per stage.

    Interleaved (V = 2): chunk c is virtual stage c * PP + s and sleeps half the costs (a micro-batch
    passes both chunks). AMDP (D = 4, 2 pipelines): chunk p is the logical stage of pipeline p on that
    device and sleeps the whole costs (a micro-batch runs on one pipeline); replicas of a logical stage
    share parameter names and initial weights.
    """
    import torch

    from megatron.trainer.tasks.synthetic import SyntheticCostTask

    task, cpu = SyntheticCostTask(), torch.device("cpu")
    cases = [
        ("interleaved-1f1b", ["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"], 2, 2),
        ("amdp", ["--num-layers", "4"], 4, 1),
    ]
    for schedule, extra, pp, chunks_per_mb in cases:
        config = _synthetic_config("--pipeline-schedule", schedule, "--pipeline-model-parallel-size", str(pp),
                                   "--global-batch-size", "4", "--train-iters", "1", *extra)
        layout = config.run.layout
        by_name: dict[str, torch.Tensor] = {}
        for s in range(pp):
            chunks = task.build_stage(config, s, cpu)
            assert [c.stage for c in chunks] == [layout.model_stage(s, c) for c in range(layout.num_chunks)]
            assert len(chunks) == layout.num_chunks == 2  # V = 2 chunks; D/2 = 2 pipelines
            visited = [chunks[c] for c in layout.microbatch_chunks(0)]
            assert len(visited) == chunks_per_mb
            assert sum(c.forward_s for c in visited) == pytest.approx(0.002), schedule
            assert sum(c.backward_s for c in visited) == pytest.approx(0.004), schedule
            assert sum(c.linear.wgrad_s for c in visited) == pytest.approx(0.006), schedule
            for name, p in task.named_parameters(chunks):
                assert name.startswith("synthetic_stage"), name
                if name in by_name:  # an AMDP replica of a logical stage hosted elsewhere
                    assert schedule == "amdp" and torch.equal(by_name[name], p.detach()), name
                by_name[name] = p.detach().clone()
        assert len(by_name) == 2 * layout.num_model_stages  # weight and bias of every model part


@pytest.mark.parametrize("schedule,stages,accumulation", [("amdp", 4, 4), ("pipedream-2bw", 3, 2)])
def test_synthetic_task_trains_amdp_and_2bw_in_the_emulator(megatron_world1, schedule, stages, accumulation) -> None:
    """The benchmark's task runs these schedules end to end (emulator): finite losses, 2BW drift 0,
    AMDP's replicas of each logical stage identical after the window updates."""
    import torch

    from megatron.trainer.tasks.synthetic import SyntheticCostTask
    from megatron.trainer.loop.training import emulate

    task = SyntheticCostTask()
    config = _synthetic_config("--pipeline-schedule", schedule, "--pipeline-model-parallel-size", str(stages),
                               "--num-layers", str(stages), "--global-batch-size", str(accumulation),
                               "--train-iters", "3", "--pipeline-executor", "emulator")
    workers = emulate(task, config)
    assert all(w.drift_histogram for w in workers)
    if schedule == "pipedream-2bw":
        assert all(set(w.drift_histogram) == {0} for w in workers)
    params: dict[str, torch.Tensor] = {}
    for w in workers:
        for name, p in task.named_parameters(w.setup.chunks):
            assert torch.isfinite(p).all(), name
            if name in params:
                assert torch.equal(params[name], p.detach()), f"{name}: AMDP replicas differ"
            params[name] = p.detach().clone()
    assert len(params) == 2 * stages  # weight and bias of every logical stage
