"""Schedules as ``torch.distributed.pipelining`` action lists, both ways (issue #44).

Export: every synchronous schedule's order as torch's compute-only CSV, run by torch's own
``_PipelineScheduleRuntime`` on CPU gloo over our megatron-core GPT stages, trains to our
runtime's losses. Import: the orders torch's schedule classes build, and hand-written CSVs, go
through the schedule check (broken ones refused in one line naming rank and action) and train
here like the equivalent schedule of ours.

Tolerances, from the numerics. Both sides run the same stage modules (same parts, layers and
init by global name), the same micro-batches, Megatron's per-micro-batch loss
``sum(loss * mask) / sum(mask)`` and AdamW with the same constants (``COMPARABLE_FLAGS``: no
weight decay, no clipping, constant rate, ``--adam-kernel single-tensor`` = torch's
``AdamW(foreach=False)`` arithmetic). What may differ:

* the order of the ``m`` terms of each gradient accumulation, wherever the two orders run the
  backward micro-batches of a part in a different order (torch's classes against our
  equivalent), and where a layout splits the same model into different parts (one chain
  against a V): fp32 sums of ``m`` terms in another order differ by about ``sqrt(m) u``
  relative (u = 2^-24), which Adam's normalised steps carry into the next losses;
* the gradient scaling: ours seeds each micro-batch's backward with ``loss / m``, torch
  divides the accumulated gradient by ``m`` (``scale_grads``). With ``m`` a power of two
  (here 4 and 8) both are exact, so they agree bit for bit;
* the logged loss: both sum the ``m`` fp32 micro-batch losses and divide by ``m``; the sum's
  order is the last part's forward order (ours) or micro-batch order (torch's ``losses``).

So losses and parameters are compared with the project's derived bounds (tests/adam_bounds.py:
``rho`` per loss, a per-element bound per parameter, from the reference run's own Adam steps);
the first iteration's loss (forwards only, on the same initial weights) exactly; and where the
order is the same on both sides (an exported order replayed here) the parameters bit for bit.
Observed (torch 2.13, CPU): torch's runtime running our exported orders matches our losses bit
for bit in every iteration too -- the same order gives the same sums -- but only the bounds are
asserted there, since torch's split backward (``I`` then ``W``, through ``autograd.grad``) is
another code path than ours, with no promise of the same kernels.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron.interop.torch_pipelining import COMPARABLE_FLAGS, TORCH_SCHEDULES, torch_order_csv
from megatron.pipeline.ir import PipelineLayout, VShapeLayout
from megatron.pipeline.schedules import SCHEDULES, ScheduleConfigError, schedule_class
from megatron.pipeline.torch_actions import TorchOrderError, check_order, order_from_schedule, parse_csv, write_csv
from megatron.pipeline.torch_export import export_order
from tests.async_helpers import (
    REPO, TINY_GPT, assert_flag_error, assert_trains_like, emulate, emulated_reference, final_params, run_pretrain)
from tests.gloo_ranks import run_on_gloo_ranks

SYNCHRONOUS = ["1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-1p", "zb-2p", "zb-v", "v-half", "v-min",
               "dualpipev"]
#: torch action types per exported schedule (the rest split B/W: F, I, W)
KINDS = {"1f1b": {"F", "B"}, "gpipe": {"F", "B"}, "interleaved-1f1b": {"F", "B"}, "dualpipev": {"F", "I", "W", "B"}}
CHAIN = ["1f1b", "gpipe", "zb-h1", "zb-h2", "zb-1p", "zb-2p"]
#: torch's class -> our schedule with the same placement and backward kind (its losses' reference)
EQUIVALENT = {"Schedule1F1B": "1f1b", "ScheduleInterleaved1F1B": "interleaved-1f1b",
              "ScheduleInterleavedZeroBubble": "interleaved-1f1b", "ScheduleZBVZeroBubble": "zb-v",
              "ScheduleDualPipeV": "dualpipev"}


def _load_tool(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def job(n: int, m: int, schedule: str, *extra: str, layers: int | None = None, iters: int = 2) -> list[str]:
    """A tiny GPT of 2N layers (one per part of a two-chunk layout) that trains comparably on both sides."""
    return [*TINY_GPT, "--num-layers", str(layers or 2 * n), "--pipeline-model-parallel-size", str(n),
            "--pipeline-schedule", schedule, "--global-batch-size", str(m), "--train-iters", str(iters),
            "--log-interval", "1", *COMPARABLE_FLAGS, *extra]


def native_flags(name: str, n: int) -> list[str]:
    """Our schedule's flags for the order export_order writes: 2 chunks of one layer for
    interleaved, zb orders from the placeholder costs (no profiling), an even chain split."""
    if name == "interleaved-1f1b":
        return ["--num-layers-per-virtual-pipeline-stage", "1"]
    zb = ["--zb-profile-iters", "0"] if name in ("zb-1p", "zb-2p", "zb-v") else []
    return [*zb, "--pipeline-layer-split", *["2"] * n]


def csv_flags(n: int) -> list[str]:
    return ["--pipeline-layer-split", *["2"] * n]  # chain: even; V: halved per chunk; loop: ignored (even)


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records if "loss" in r]


# --------------------------------------------------------------------------- pure: export / parse


def test_every_synchronous_schedule_exports_and_reads_back():
    assert sorted(SYNCHRONOUS) == sorted(n for n, c in SCHEDULES.items() if not c.traits.asynchronous)
    for n in (2, 4):
        for name in SYNCHRONOUS:
            order = export_order(name, n, 2 * n)
            back = parse_csv(order.to_csv())
            assert back == order, name
            check_order(back)
            kinds = {a.kind for row in order.ranks for a in row}  # B/W split -> I, W; fused -> B
            assert kinds == KINDS.get(name, {"F", "I", "W"}), name
            if isinstance(order.layout, VShapeLayout):  # torch's V numbering: rank r holds r and 2N-1-r
                assert all({a.stage for a in row} == {r, 2 * n - 1 - r} for r, row in enumerate(order.ranks))
            elif order.layout.num_chunks > 1:  # loop: r, r + N
                assert all({a.stage for a in row} == {r, r + n} for r, row in enumerate(order.ranks))
            else:
                assert all({a.stage for a in row} == {r} for r, row in enumerate(order.ranks))
            # the ops come back as ours (one iteration, no OPT), in the same order
            built = export_order(name, n, 2 * n)
            assert [list(back.iteration_ops(r)) for r in range(n)] == built.streams()


def test_asynchronous_schedules_are_refused_with_the_reason(capsys):
    tool = _load_tool("export_schedule")
    for name in (n for n, c in SCHEDULES.items() if c.traits.asynchronous and n != "async-1f1b"):
        assert tool.main(["--schedule", name, "--pipeline-model-parallel-size", "2", "--microbatches", "4"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "asynchronous" in err[0] and "no optimizer step inside an iteration" in err[0], err


def test_export_tool_writes_the_csv_and_the_torchtitan_settings(tmp_path, capsys):
    tool = _load_tool("export_schedule")
    out = tmp_path / "zbv.csv"
    assert tool.main(["--schedule", "zb-v", "--pipeline-model-parallel-size", "4", "--microbatches", "8",
                      "--zb-costs", "1,2,1,0", "--format", "torch-csv", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pipeline_parallel_schedule_csv" in text and "V placement" in text and "8 micro-batches" in text
    order = parse_csv(out.read_text())
    assert order.layout == VShapeLayout(4) and order.num_microbatches == 8
    assert tool.main(["--schedule", "interleaved-1f1b", "--pipeline-model-parallel-size", "2",
                      "--microbatches", "4"]) == 0
    assert parse_csv(capsys.readouterr().out).layout == PipelineLayout(2, 2)


BROKEN = {
    "missing W": ("0F0,0I0,0W0,0F1,0I1\n1F0,1I0,1W0,1F1,1I1,1W1\n", "rank 0: 0I1 never gets its 0W1"),
    "backward before forward": ("0F0,0B0,0B1,0F1\n1F0,1B0,1F1,1B1\n", "rank 0, action 2 0B1: runs before the forward 0F1"),
    "unknown action": ("0F0,0X0,0B0\n1F0,1B0\n", "rank 0, action 1 '0X0': unknown action"),
    "deadlock": ("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n", "deadlock: rank 0: blocked at action 0B0 (rank 0)"),
    "placement": ("0F0,1F0,1B0,0B0\n2F0,3F0,3B0,2B0\n", "rank 0 runs stage 1: the stage-to-rank mapping is neither"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_csv_is_refused_in_one_line_before_any_rank_starts(case, tmp_path, capsys):
    text, fragment = BROKEN[case]
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(TorchOrderError) as exc:
        check_order(parse_csv(text, source=str(path)), source=str(path))
    assert fragment in str(exc.value) and "\n" not in str(exc.value)
    # the trainer refuses it while parsing its flags (nothing launched yet), in one line
    assert_flag_error(capsys, ["--pipeline-schedule", f"torch-csv:{path}", "--global-batch-size", "2"], fragment)
    # so does the simulator
    with pytest.raises(SystemExit) as exit_:
        _load_tool("simulate_schedule").main(["--torch-csv", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and fragment in err[0], err


def test_csv_schedule_must_match_the_run(tmp_path):
    from megatron.pipeline.schedules import ScheduleConfig, build_schedule

    with pytest.raises(ScheduleConfigError, match="cannot read"):
        schedule_class("torch-csv:/nonexistent.csv")
    path = tmp_path / "1f1b.csv"
    write_csv(export_order("1f1b", 2, 4), str(path))
    for config, why in ((ScheduleConfig(2, 8, 1), "runs 4 micro-batches"), (ScheduleConfig(4, 4, 1), "has 2 ranks")):
        with pytest.raises(ScheduleConfigError, match=why):
            build_schedule(f"torch-csv:{path}", config)
    schedule = build_schedule(f"torch-csv:{path}", ScheduleConfig(2, 4, 3))  # 3 iterations: the order, then OPT
    ops = list(schedule.stage_ops(0))
    assert [str(op) for op in ops if op.kind.value == "OPT"] == ["OPT#0(sync)@s0", "OPT#1(sync)@s0", "OPT#2(sync)@s0"]
    assert order_from_schedule(schedule.segment(2, 1)) == export_order("1f1b", 2, 4)  # renumbered per iteration


def test_simulator_reads_a_torch_csv(tmp_path, capsys):
    path = tmp_path / "dualpipev.csv"
    path.write_text(torch_order_csv("ScheduleDualPipeV", 4, 8))
    assert _load_tool("simulate_schedule").main(["--torch-csv", str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["chunks"] == 2 and 0 < got["bubble_rate"] < 0.1


def test_torch_classes_that_are_ours_build_our_orders():
    """docs/schedules.md: four of torch's classes order exactly as one of ours."""
    for torch_class, ours in (("ScheduleDualPipeV", "dualpipev"), ("ScheduleInterleaved1F1B", "interleaved-1f1b"),
                              ("Schedule1F1B", "1f1b"), ("ScheduleGPipe", "gpipe")):
        for m in (8, 16):
            assert parse_csv(torch_order_csv(torch_class, 4, m)).ranks == export_order(ours, 4, m).ranks, torch_class


def test_docs_table_is_the_tools_output():
    """docs/schedules.md's torch comparison is what the command above it prints."""
    rows = _load_tool("export_schedule").compare_rows(4, [8, 16])
    doc = (REPO / "docs" / "schedules.md").read_text()
    assert "tools/export_schedule.py --compare-torch --pipeline-model-parallel-size 4 --microbatches 8 16" in doc
    assert all(row in doc for row in rows), [row for row in rows if row not in doc]
    assert len(rows) == len(TORCH_SCHEDULES) + len(SYNCHRONOUS)


# --------------------------------------------------------------------------- emulator: import


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8)])
@pytest.mark.parametrize("torch_class", sorted(EQUIVALENT))
def test_torch_orders_import_check_and_train_like_ours(torch_class, n, m, tmp_path, megatron_world1):
    """torch's own order, imported: passes the schedule check and trains (emulator) like our
    equivalent synchronous schedule (another backward order: the derived bounds)."""
    path = tmp_path / f"{torch_class}.csv"
    path.write_text(torch_order_csv(torch_class, n, m))
    order = parse_csv(path.read_text())
    check_order(order)
    ours = EQUIVALENT[torch_class]
    ref = emulated_reference(job(n, m, ours, *native_flags(ours, n)), tmp_path / "ref.jsonl")
    log = tmp_path / "csv.jsonl"
    workers = emulate([*job(n, m, f"torch-csv:{path}", *csv_flags(n)), "--pipeline-executor", "emulator",
                       "--log-json", str(log)])
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert_trains_like(records, final_params(workers), ref, keys=("loss", "grad_norm"), context=torch_class)


def test_chain_exports_replay_bitwise_on_the_emulator(tmp_path, megatron_world1):
    """At N = 4, each chain schedule's exported CSV replays here to the very same numbers as the
    schedule itself: the same ops in the same order, so the same bits."""
    n, m = 4, 8
    for name in CHAIN:
        path = tmp_path / f"{name}.csv"
        write_csv(export_order(name, n, m), str(path))
        native = final_params(emulate([*job(n, m, name, *native_flags(name, n)), "--pipeline-executor", "emulator"]))
        replay = final_params(emulate([*job(n, m, f"torch-csv:{path}", *csv_flags(n)), "--pipeline-executor", "emulator"]))
        assert native.keys() == replay.keys()
        assert all(torch.equal(native[k], replay[k]) for k in native), name


# --------------------------------------------------------------------------- torch's runtime


def _torch_worker(rank: int, world: int, jobs: dict[str, tuple[list[str], str]], out: str) -> None:
    from megatron.interop.torch_pipelining import train_torch_runtime

    got = {}
    for name, (argv, path) in jobs.items():
        result = train_torch_runtime(argv, path, rank, world)
        if result is not None:
            got[name] = result
    Path(f"{out}.{rank}").write_text(json.dumps(got))


def run_in_torch(jobs: dict[str, tuple[list[str], str]], world: int, out: Path) -> dict[str, list[float]]:
    run_on_gloo_ranks(_torch_worker, world, jobs, str(out), world_size=world, timeout_s=300)
    merged: dict[str, list[float]] = {}
    for rank in range(world):
        merged.update(json.loads(Path(f"{out}.{rank}").read_text()))
    return merged


def test_exported_orders_train_in_torch_runtime_like_ours(tmp_path, megatron_world1):
    """Every synchronous schedule at N = 2, exported and run by torch's _PipelineScheduleRuntime on
    gloo over our GPT stages: the losses of our runtime (the emulator per schedule, which is bitwise
    the distributed runtime, tests/test_*: assert_runtime_equals_emulator; and the distributed
    runtime itself on zb-h1 and on the exported dualpipev CSV)."""
    n, m = 2, 4
    jobs = {}
    for name in SYNCHRONOUS:
        path = tmp_path / f"{name}.csv"
        write_csv(export_order(name, n, m), str(path))
        jobs[name] = (job(n, m, "1f1b", *csv_flags(n)), str(path))
    got = run_in_torch(jobs, n, tmp_path / "torch")
    assert sorted(got) == sorted(SYNCHRONOUS)
    rho = {}
    for name in SYNCHRONOUS:
        ref = emulated_reference(job(n, m, name, *native_flags(name, n)), tmp_path / f"{name}.jsonl")
        want = losses(ref.records)
        assert len(got[name]) == len(want) == 2, name
        assert got[name][0] == want[0], name  # iteration 1: the same forwards on the same weights and data
        assert got[name] == pytest.approx(want, rel=ref.rho), name
        rho[name] = ref.rho
    # our distributed runtime: running zb-h1 itself, and running the exported dualpipev CSV
    records, _ = run_pretrain(job(n, m, "zb-h1", *native_flags("zb-h1", n)), tmp_path / "dist-zbh1")
    assert got["zb-h1"][0] == losses(records)[0] and got["zb-h1"] == pytest.approx(losses(records), rel=rho["zb-h1"])
    records, _ = run_pretrain(job(n, m, f"torch-csv:{jobs['dualpipev'][1]}", *csv_flags(n)), tmp_path / "dist-v")
    assert got["dualpipev"][0] == losses(records)[0]
    assert got["dualpipev"] == pytest.approx(losses(records), rel=rho["dualpipev"])


def test_planner_top_candidate_runs_in_torch_runtime(tmp_path, capsys, megatron_world1):
    """tools/plan_pipeline.py --export-csv at N = 4: its top synchronous candidate's CSV trains in
    torch's runtime to the losses of our emulator running the candidate's own flags."""
    n, m = 4, 8
    model = [*TINY_GPT, "--num-layers", str(2 * n), "--global-batch-size", str(m)]
    plan = _load_tool("plan_pipeline")
    out = tmp_path / "plan"
    assert plan.main([*model, "--pipeline-sizes", str(n), "--device", "cpu", "--recompute", "none",
                      "--layer-splits", "even", "--top", "1", "--json", "--export-csv", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    top = result["candidates"][result["synchronous"][0]]
    csv = sorted(out.glob("01_*.csv"))
    assert len(csv) == 1 and top["schedule"] in csv[0].name
    assert "pipeline_parallel_schedule_csv" in (out / "README.md").read_text()
    flags = [*model, *top["flags"], "--train-iters", "2", "--log-interval", "1", *COMPARABLE_FLAGS]
    ref = emulated_reference(flags, tmp_path / "ref.jsonl")
    got = run_in_torch({"top": (flags, str(csv[0]))}, n, tmp_path / "torch")
    want = losses(ref.records)
    assert len(got["top"]) == len(want) == 2 and got["top"][0] == want[0]
    assert got["top"] == pytest.approx(want, rel=ref.rho), top["flags"]
