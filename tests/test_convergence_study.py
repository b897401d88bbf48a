"""The convergence-study harness: its metrics against hand-computed references, its grid, and
the reduced (``ci``) study end to end, checked against a direct ``pretrain_gpt.py`` run and
against PACI's drift bound."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

from megatron.studies.grid import CI, FULL, depth_study, paci_study, study_runs
from megatron.studies.metrics import iterations_to_target, slowdowns, trailing_mean, value_at
from megatron.studies.runner import check_argv

from async_helpers import REPO, read_log

# -- metrics ---------------------------------------------------------------------------------

def test_trailing_mean_matches_a_direct_window_mean() -> None:
    values = list(numpy.random.default_rng(0).normal(size=50))
    for window in (1, 3, 7):
        expected = [numpy.mean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]
        numpy.testing.assert_allclose(trailing_mean(values, window), expected, rtol=1e-12)


def test_iterations_to_target_interpolates_the_crossing() -> None:
    iterations = [1, 2, 3, 4, 5]
    losses = [9.0, 8.0, 6.0, 5.0, 4.0]
    assert iterations_to_target(iterations, losses, 7.0) == pytest.approx(2.5)  # between 8 and 6
    assert iterations_to_target(iterations, losses, 9.5) == 1.0  # already there
    assert iterations_to_target(iterations, losses, 5.0) == 4.0
    assert iterations_to_target(iterations, losses, 3.0) is None  # never reached
    assert value_at(iterations, losses, 2.5) == pytest.approx(7.0)
    assert value_at(iterations, losses, 99) == 4.0


def test_slowdown_is_relative_to_the_same_methods_depth_one() -> None:
    table = slowdowns({"a": {1: 10.0, 8: 25.0, 32: None}, "b": {1: None, 8: 5.0}})
    assert table == {"a": {1: 1.0, 8: 2.5, 32: None}, "b": {1: None, 8: None}}


# -- grid ------------------------------------------------------------------------------------

def _flag(flags, name):
    return flags[list(flags).index(name) + 1]


@pytest.mark.parametrize("preset", [FULL, CI], ids=lambda p: p.name)
def test_every_run_of_a_preset_parses_and_varies_only_what_its_study_varies(preset) -> None:
    runs = study_runs(preset)
    assert len({r.name for r in runs}) == len(runs)
    for r in runs:
        check_argv(list(r.flags))  # the data flags are the study's own (mock data here)
        assert int(_flag(r.flags, "--global-batch-size")) == preset.global_batch  # equal tokens per update
        assert _flag(r.flags, "--train-iters") == str(preset.paci_iterations if r.study == "paci" else preset.iterations)
        assert _flag(r.flags, "--pipeline-model-parallel-size") == str(r.depth)
    paci = paci_study(preset)
    a = [preset.global_batch // int(_flag(r.flags, "--micro-batch-size")) for r in paci]
    # flush first, one micro-batch; then every a with AdamW, Muon and the look-ahead
    assert a == [1, *preset.paci_accumulations * 3] * len(preset.paci_lrs)
    assert [float(_flag(r.flags, "--lr")) for r in paci[::len(a) // len(preset.paci_lrs)]] == list(preset.paci_lrs)
    optimizers = [_flag(r.flags, "--optimizer") if "--optimizer" in r.flags else "adamw" for r in paci]
    per_lr = ["adamw", *[o for o in ("adamw", "muon", "delay-nesterov") for _ in preset.paci_accumulations]]
    assert optimizers == per_lr * len(preset.paci_lrs)
    depth = depth_study(preset)
    assert {r.depth for r in depth} == set(preset.depths)
    assert len(depth) == 8 * len(preset.depths)  # AdamW, PipeMare-LR, basis rotation 2 x 2, Muon, look-ahead
    assert {_flag(r.flags, "--num-layers") for r in depth} == {str(preset.depth_layers)}  # one model


@pytest.mark.parametrize("preset", [CI, FULL], ids=["ci", "full"])
def test_every_run_trains_the_same_untied_model_on_an_even_split(preset) -> None:
    """Flush ties by default and asynchronous schedules cannot: the study unties every run, so
    all train one model; the depth sweep keeps P equal shares of the layers (the balanced default
    would move them, and with them each stage's share of the delay)."""
    from megatron.trainer.plan.parse import parse_run_plan

    for r in study_runs(preset):
        plan = parse_run_plan([*r.flags, "--mock-data"])
        assert not plan.embeddings.tied, (r.name, plan.embeddings.line)
        if r.study == "depth":
            assert plan.layers.counts is None and plan.layers.partition in ("even", "balanced"), (r.name, plan.layers)


def test_full_preset_is_the_documented_study() -> None:
    assert FULL.paci_depth == 8 and FULL.paci_accumulations == (1, 4, 8)
    assert FULL.depths == (1, 2, 4, 8, 16, 32) and FULL.depth_layers >= 32
    # PACI's bound ceil((N - 1 - s)/a) at N = 8: a = 4 gives Delta_max <= 2, a = 8 gives 1.
    assert [math.ceil(7 / a) for a in (4, 8)] == [2, 1]


# -- the reduced study, end to end -----------------------------------------------------------

def _tool(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "convergence_study.py"), *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"))


@pytest.fixture(scope="module")
def ci_study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("convergence")
    proc = _tool("--output-dir", str(out), "--preset", "ci")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_ci_study_writes_curves_tables_and_plots(ci_study: Path) -> None:
    report = json.loads((ci_study / "convergence.json").read_text())
    assert len(report["runs"]) == len(study_runs(CI))
    for run in report["runs"]:
        assert run["iterations"] == list(range(1, (CI.paci_iterations if run["study"] == "paci" else CI.iterations) + 1))
        assert run["tokens"] == [i * CI.tokens_per_update for i in run["iterations"]]
        assert all(numpy.isfinite(run["loss"]))
        assert run["loss"][0] == pytest.approx(math.log(1024), abs=0.3)  # uniform over the vocabulary
    for png in ("paci_loss.png", "depth_loss.png", "depth_slowdown.png"):
        data = (ci_study / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    summary = (ci_study / "summary.md").read_text()
    assert "| PACI a=4 |" in summary and "| BR 2nd/Bi |" in summary
    assert "| PACI a=4 + Muon |" in summary and "| PACI a=4 + look-ahead |" in summary
    assert "| Muon |" in summary and "| Look-ahead |" in summary
    depth = report["depth"]
    assert all(depth["slowdown"][m]["1"] == 1.0 for m in depth["slowdown"])  # JSON keys are strings


@pytest.mark.slow
def test_ci_study_paci_drift_reaches_the_papers_bound(ci_study: Path) -> None:
    """Measured per-stage Delta_max of every asynchronous run equals ceil((N - 1 - s)/a)."""
    groups = json.loads((ci_study / "convergence.json").read_text())["paci"]["groups"]
    assert [g["lr"] for g in groups] == list(CI.paci_lrs)
    rows = [row for g in groups for row in g["rows"]]
    assert len(rows) == len(paci_study(CI))
    n = CI.paci_depth
    for row in rows:
        expected = [0] * n if row["schedule"] == "1f1b" else [math.ceil((n - 1 - s) / row["a"]) for s in range(n)]
        assert row["drift_max"] == row["drift_bound"] == expected, row


@pytest.mark.slow
def test_a_study_run_is_the_same_run_as_pretrain_gpt(ci_study: Path, tmp_path: Path) -> None:
    """The harness adds nothing: a run's curve equals the user command with the same flags."""
    run = json.loads((ci_study / "runs" / "paci-paci-a-4-lr0.001-p4.json").read_text())
    argv = list(run["argv"])
    argv[argv.index("--log-json") + 1] = str(tmp_path / "log.jsonl")
    argv[argv.index("--data-cache-path") + 1] = str(tmp_path / "cache")
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_log(tmp_path / "log.jsonl")
    assert [r["loss"] for r in records if "eval_split" not in r] == run["loss"]
    assert [r["eval_loss"] for r in records if r.get("eval_split") == "valid"] == [e["loss"] for e in run["eval"]]


@pytest.mark.slow
def test_rerun_reuses_saved_runs_and_reports_the_same(ci_study: Path) -> None:
    before = json.loads((ci_study / "convergence.json").read_text())
    proc = _tool("--output-dir", str(ci_study), "--preset", "ci", "--study", "paci")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{len(paci_study(CI))} saved, 0 to run" in proc.stdout
    after = json.loads((ci_study / "convergence.json").read_text())
    assert after["paci"] == before["paci"]


def test_bad_flags_fail_in_one_line_before_any_run(tmp_path: Path) -> None:
    proc = _tool("--output-dir", str(tmp_path), "--data-path", str(tmp_path / "missing"), "--tokenizer-dir", "x")
    assert proc.returncode == 2
    assert "no " in proc.stderr and "missing.idx" in proc.stderr
    assert not (tmp_path / "runs").exists()
