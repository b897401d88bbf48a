"""tools/plan_pipeline.py: the trainer's flags in, the JSON interface out, refusals in one line,
the pasted flags accepted by the trainer, the saved-costs round trip and the PNG (issue 32)."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from megatron.pipeline.planner.report import CANDIDATE_FIELDS

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("plan_pipeline", ROOT / "tools" / "plan_pipeline.py")
plan = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(plan)

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--vocab-size", "64", "--micro-batch-size", "1", "--global-batch-size", "4"]
SMALL = [*MODEL, "--pipeline-sizes", "2", "--schedules", "1f1b,gpipe,paci,zb-h1", "--recompute", "none,selective"]


def _json(capsys, argv: list[str]) -> dict:
    assert plan.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_interface_and_flags_the_trainer_accepts(capsys):
    from megatron.trainer.plan.parse import parse_args

    out = _json(capsys, [*SMALL, "--device", "h100"])
    assert {c["schedule"] for c in out["candidates"]} == {"1f1b", "gpipe", "paci", "zb-h1"}
    assert set(CANDIDATE_FIELDS) <= set(out["candidates"][0])
    best = out["candidates"][out["synchronous"][0]]
    assert best["semantics"] == "exact" and best["fits"]
    assert all(out["candidates"][i]["semantics"] != "exact" for i in out["asynchronous"])
    for i in (out["synchronous"][0], out["asynchronous"][0]):  # the flags to paste parse and validate
        args = parse_args([*MODEL, "--mock-data", *out["candidates"][i]["flags"]])
        assert args.pipeline_schedule == out["candidates"][i]["schedule"]
        assert args.num_microbatches == out["candidates"][i]["microbatches"]


def test_saved_costs_round_trip(capsys, tmp_path):
    saved = tmp_path / "costs.json"
    first = _json(capsys, [*SMALL, "--device", "a100", "--save-costs", str(saved)])
    again = _json(capsys, [*SMALL, "--costs", str(saved), "--device-memory-gb", "80"])
    assert [c["tokens_per_s"] for c in again["candidates"]] == [c["tokens_per_s"] for c in first["candidates"]]


@pytest.mark.parametrize("extra, message", [
    ([], "exactly one cost source"),
    (["--device", "h100", "--costs", "x.json"], "exactly one cost source"),
    (["--device", "tpu"], "invalid choice"),
    (["--device", "h100", "--pipeline-sizes", "0"], "positive integers"),
    (["--device", "h100", "--schedules", "nope"], "choose from"),
    (["--device", "h100", "--device-memory-gb", "0"], "must be positive"),
])
def test_refusals_are_one_line(capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        plan.main([*MODEL, *extra])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and message in err and len(err.splitlines()) == 1


def test_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    assert plan.main([*SMALL, "--device", "cpu", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "synchronous" in capsys.readouterr().out


def test_profile_activation_bytes_from_the_measured_peaks() -> None:
    """The profile divides each stage's measured peak by ZB-H1's simulated peak (in M_B, with
    the profiled m_w): stage 0 holds N = 2 micro-batches' activations at its peak, stage 1 one
    plus what its W's are still owed (m_w = 0.5)."""
    from megatron.trainer.tasks.plan_profile import measured_activations

    layer, head, layers = 3.0e6, 5.0e6, 4
    cost = {"t_f": 1.0, "t_b": 1.0, "t_w": 1.0, "m_w": 0.5}
    decision = {"num_microbatches": 4, "costs": [cost, cost]}
    stage0, stage1 = layers * layer, layers * layer + head
    mib = 2.0 ** 20
    records = [{"peak_activation_mb": [2 * stage0 / mib, 1.5 * stage1 / mib]}] * 2
    got = measured_activations(decision, records, layers)
    assert got is not None
    saved, kept = got
    assert saved.layer == pytest.approx(layer, rel=1e-12) and saved.head == pytest.approx(head, rel=1e-12)
    assert kept.layer == pytest.approx(0.5 * layer, rel=1e-12) and kept.head == pytest.approx(0.5 * head, rel=1e-12)
    assert measured_activations(decision, [], layers) is None


def test_trainer_argv_drops_every_planner_flag() -> None:
    parser = plan.build_parser()
    options = plan.planner_options(parser)
    assert {"--probe-convergence", "--pipeline-sizes", "--device", "--json", "--profile"} <= set(options)
    argv = [*MODEL, "--pipeline-sizes", "2,4", "--device=h100", "--json", "--probe-convergence", "8", "--lr", "0.1"]
    assert plan.trainer_argv(argv, parser) == [*MODEL, "--lr", "0.1"]


def test_probe_summary_by_hand() -> None:
    """1F1B's running mean (window 2) ends at (2 + 1) / 2 = 1.5: the target. The stale run's
    running means are 4, 3.5, 2.5, 1.5: it reaches the target at its 4th update, 4 x 10 tokens,
    in 40 / 20 = 2 s against 1F1B's 3 x 10 / 10 = 3 s: 1.5x; a run that never gets there is None."""
    from megatron.trainer.tasks.convergence_probe import ProbeResult, summary

    ref = ProbeResult("1f1b", 2, 4, [4.0, 2.0, 1.0], 10, 10.0)
    stale = ProbeResult("paci", 2, 4, [4.0, 3.0, 2.0, 1.0], 10, 20.0)
    never = ProbeResult("pipedream-2bw", 2, 4, [4.0, 3.0, 2.0], 10, 40.0)
    rows = summary([ref, stale, never], window=2)
    assert rows[0]["tokens_to_target"] == 30 and rows[0]["time_to_target_s"] == 3.0
    assert rows[1]["tokens_to_target"] == 40 and rows[1]["speedup_vs_1f1b"] == 1.5
    assert rows[1]["loss_gap"] == 0.0 and rows[2]["loss_gap"] == 1.0
    assert rows[2]["tokens_to_target"] is None and rows[2]["speedup_vs_1f1b"] is None


def test_probe_convergence_end_to_end(capsys) -> None:
    """A 4-update probe of 1F1B and PACI at reduced width: one row each, 1F1B first and at gap 0,
    in the JSON next to the plan."""
    argv = [*MODEL, "--mock-data", "--pipeline-sizes", "2", "--schedules", "1f1b,paci", "--recompute", "none",
            "--layer-splits", "even", "--device", "cpu", "--probe-convergence", "4"]
    out = _json(capsys, argv)
    rows = out["convergence_probe"]
    assert [r["schedule"] for r in rows] == ["1f1b", "paci"]
    assert rows[0]["loss_gap"] == 0.0 and rows[0]["speedup_vs_1f1b"] == 1.0
    assert all(math.isfinite(r["final_loss"]) for r in rows)


@pytest.mark.parametrize("flag", ["--png", "--save-costs"])
def test_an_output_path_that_cannot_be_written_is_refused_before_planning(tmp_path, capsys, flag):
    """A file where a directory should be used to end in a NotADirectoryError traceback after
    the whole plan was simulated (#42)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    for path, why in ((blocker / "x.png", f"{blocker} is a file, not a directory"),
                      (tmp_path / "missing" / "x.png", f"{tmp_path / 'missing'} does not exist"),
                      (tmp_path, "is a directory")):
        with pytest.raises(SystemExit) as e:
            plan.main([*SMALL, "--device", "cpu", flag, str(path)])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and err.endswith(f"{flag} {path}: {why}"), err


def test_pipeline_sizes_that_cannot_be_ranked_say_why(capsys):
    """More stages than layers: no candidate; the tool used to print an empty table and exit 0."""
    assert plan.main([*MODEL, "--device", "h100", "--pipeline-sizes", "16", "--schedules", "1f1b,zb-v"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip().splitlines()
    assert err[0] == "error: no candidate can be ranked:"
    assert "  --pipeline-sizes 16: 4 layers cannot fill 16 stages (each needs a layer at least)" in err
    # one size ranks, the other is named with its reason, and the plan still prints
    assert plan.main([*MODEL, "--device", "h100", "--pipeline-sizes", "2,16", "--schedules", "1f1b"]) == 0
    captured = capsys.readouterr()
    assert "note: --pipeline-sizes 16: 4 layers cannot fill 16 stages (each needs a layer at least)" in captured.err
    assert "1f1b" in captured.out


def _gpt_parameters(tied: bool) -> int:
    """MODEL's GPT from its flags (h 32, 4 layers, vocabulary 64, 16 learned positions): V h + P h
    + L (12 h^2 + 13 h) + 2 h with the vocabulary matrix once, twice when untied."""
    h, layers, vocab, positions = 32, 4, 64, 16
    return vocab * h + positions * h + layers * (12 * h * h + 13 * h) + 2 * h + (0 if tied else vocab * h)


def _rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line[:2].strip().isdigit()]


def test_candidates_record_their_model_and_those_training_another_are_marked_after_the_rest(capsys):
    """Like with like: the user's flags ask for the tied model (Megatron-LM's default); every
    candidate records its tie and parameter count, and the asynchronous ones (untied) are
    marked ``same_model: false``, listed in ``different_model`` and starred in the table."""
    out = _json(capsys, [*SMALL, "--device", "h100"])
    assert out["model"]["tied_embeddings"] is True and out["model"]["parameters"] == _gpt_parameters(True)
    untied = [i for i, c in enumerate(out["candidates"]) if c["semantics"] != "exact"]
    assert untied and out["different_model"] == untied
    for c in out["candidates"]:
        exact = c["semantics"] == "exact"
        assert c["same_model"] is exact and c["tied_embeddings"].startswith("tied" if exact else "untied: each stage")
        assert c["parameters"] == _gpt_parameters(exact)
    assert plan.main([*SMALL, "--device", "h100"]) == 0
    sync, asyn = capsys.readouterr().out.split("asynchronous (stale weights")
    assert _rows(sync) and not any(row[2] == "*" for row in _rows(sync)) and "note:" not in sync
    assert _rows(asyn) and all(row[2] == "*" for row in _rows(asyn))
    assert (f"note: your flags ask for tied embeddings ({_gpt_parameters(True):,} parameters); " in asyn
            and f"train another model, listed after the rest: untied: each stage steps on its own clock" in asyn
            and f"({_gpt_parameters(False):,} parameters)" in asyn)


def test_untied_flags_make_every_candidate_the_same_model(capsys):
    out = _json(capsys, [*SMALL, "--device", "h100", "--untie-embeddings-and-output-weights"])
    assert out["model"]["tied_embeddings"] is False and out["different_model"] == []
    assert all(c["same_model"] and c["parameters"] == _gpt_parameters(False)
               and c["tied_embeddings"] == "untied: --untie-embeddings-and-output-weights" for c in out["candidates"])


def test_post_validation_chains_are_listed_after_the_v_layouts_that_tie(capsys):
    """Under --enable-optimizer-post-validation a chain at PP 2 trains untied; the V (both ends on
    stage 0) ties: the synchronous ranking lists every V candidate before any chain."""
    out = _json(capsys, [*MODEL, "--pipeline-sizes", "2", "--schedules", "zb-h1,zb-v", "--recompute", "none",
                         "--device", "h100", "--enable-optimizer-post-validation"])
    ranked = [out["candidates"][i] for i in out["synchronous"]]
    assert {c["schedule"] for c in ranked} == {"zb-h1", "zb-v"}
    same = [c["same_model"] for c in ranked]
    assert same == sorted(same, reverse=True)
    assert all(c["same_model"] == (c["schedule"] == "zb-v") for c in ranked)
    assert all(c["tied_embeddings"].startswith("untied: --enable-optimizer-post-validation")
               for c in ranked if c["schedule"] == "zb-h1")
