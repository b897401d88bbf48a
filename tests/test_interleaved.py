"""Interleaved 1F1B (Megatron-LM's virtual pipeline stages).

- the order is Megatron's: the schedule table, the warm-up count, hand-checked streams;
- the schedule check accepts every generated configuration Megatron allows and the schedule
  refuses the others with one line;
- the per-stage peak of in-flight (micro-batch, chunk) activations is ``min(w + 1, m V)``
  with Megatron's warm-up ``w``: from the streams, the emulator and the distributed runtime;
- the distributed runtime trains interleaved PP=2 (the case where megatron-core's batched
  P2P sends wrong activations) and PP=4 to the losses and parameters of plain 1F1B on the
  same model, and equals the emulator bitwise with dropout on.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron.pipeline.ir import BW, F, OPT, OpKind, PipelineLayout
from megatron.pipeline.schedules import ScheduleConfig, ScheduleConfigError, build_schedule
from megatron.pipeline.schedules.sync.interleaved import Interleaved1F1B, forward_slots, warmup_forwards
from megatron.pipeline.schedule_check import check_schedule, check_streams
from megatron.trainer.plan.parse import parse_args, parse_run_plan
from tests.async_helpers import Reference, assert_trains_like, emulate, emulated_reference, final_params, run_pretrain, tiny_args
from megatron.pipeline.schedules.sync.interleaved import InterleavedOptions

NAME = "interleaved-1f1b"
ITERATIONS = 2


def config(n: int, m: int, v: int, group: int | None = None, iterations: int = ITERATIONS) -> ScheduleConfig:
    options = InterleavedOptions(microbatch_group_size=group)
    return ScheduleConfig(n, m, num_iterations=iterations, num_chunks=v, options=options)


def peak_in_flight(ops) -> int:
    live = peak = 0
    for op in ops:
        if op.kind is OpKind.F:
            live += 1
            peak = max(peak, live)
        elif op.kind is OpKind.BW:
            live -= 1
    return peak


def expected_peaks(n: int, m: int, v: int) -> list[int]:
    """Megatron's warm-up w = 2 (N - s - 1) + (V - 1) N forwards, then one more before the
    first backward: min(w + 1, m V) (all of them when the warm-up covers the iteration)."""
    return [min(2 * (n - s - 1) + (v - 1) * n + 1, m * v) for s in range(n)]


# ------------------------------------------------------------------ Megatron's order


def test_schedule_table_matches_megatrons_documented_example() -> None:
    # megatron-core's comment on get_schedule_table: PP=2, group 3, M=5, VP=2.
    slots = forward_slots(5, 2, 3)
    assert [mb for mb, _ in slots] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in slots] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


def test_hand_checked_streams() -> None:
    # N=2, V=2, m=2: stage 0 warms up with 2 + 2 = 4 = all forwards; stage 1 with 2.
    s0, s1 = (list(s) for s in build_schedule(NAME, config(2, 2, 2, iterations=1)).streams())
    assert s0 == [F(0, 0, 0), F(0, 1, 0), F(0, 0, 1), F(0, 1, 1),
                  BW(0, 0, 1), BW(0, 1, 1), BW(0, 0, 0), BW(0, 1, 0), OPT(0, 0, True)]
    assert s1 == [F(1, 0, 0), F(1, 1, 0), F(1, 0, 1), BW(1, 0, 1), F(1, 1, 1), BW(1, 1, 1),
                  BW(1, 0, 0), BW(1, 1, 0), OPT(1, 0, True)]
    # N=4, V=2, m=4, last stage: warm-up (V - 1) N = 4, then F/B pairs, chunk 1 backwards first.
    s3 = list(build_schedule(NAME, config(4, 4, 2, iterations=1)).stage_ops(3))
    assert s3 == [*(F(3, j, 0) for j in range(4)),
                  *(op for j in range(4) for op in (F(3, j, 1), BW(3, j, 1))),
                  *(BW(3, j, 0) for j in range(4)), OPT(3, 0, True)]


def test_second_iteration_uses_global_microbatch_indices() -> None:
    ops = list(build_schedule(NAME, config(2, 4, 2)).stage_ops(0))
    first, second = ops[: len(ops) // 2], ops[len(ops) // 2:]
    assert first[-1] == OPT(0, 0, True) and second[-1] == OPT(0, 1, True)
    assert [(op.kind, op.microbatch - 4, op.chunk) for op in second[:-1]] == \
        [(op.kind, op.microbatch, op.chunk) for op in first[:-1]]


# ------------------------------------------------------------------ (a) schedule check


def test_schedule_check_accepts_every_allowed_configuration() -> None:
    checked = 0
    for n in range(2, 9):
        for v in (2, 3):
            for m in range(n, 3 * n + 1, n):
                counts = check_schedule(build_schedule(NAME, config(n, m, v)))
                # Every stage forwards and backwards each micro-batch through each chunk once.
                assert counts == [ITERATIONS * (2 * m * v + 1)] * n, (n, v, m)
                checked += 1
    assert checked == 7 * 2 * 3


def test_microbatches_not_a_multiple_of_stages_are_a_config_error() -> None:
    """With the default group size (N), Megatron needs m to be a multiple of N."""
    for n in range(2, 9):
        for v in (2, 3):
            for m in range(1, 3 * n + 1):
                if m % n:
                    with pytest.raises(ScheduleConfigError, match=f"{m} micro-batches|group size {n}"):
                        build_schedule(NAME, config(n, m, v))


@pytest.mark.parametrize("n,m,v,group", [(3, 8, 2, 4), (4, 10, 2, 5), (4, 10, 3, 6), (5, 12, 2, 7)])
def test_schedule_check_accepts_larger_microbatch_groups(n: int, m: int, v: int, group: int) -> None:
    """Megatron's general case: N <= G <= m, remainder m mod G zero or >= N."""
    check_schedule(build_schedule(NAME, config(n, m, v, group)))


@pytest.mark.parametrize("n,m,v,group,why", [
    (4, 6, 2, None, "last group of 2"),   # m not a multiple of N (default group N)
    (4, 2, 2, None, "must lie in"),       # m < N
    (4, 9, 2, 4, "last group of 1"),      # remainder 1 < N
    (4, 8, 2, 3, "must lie in"),          # group below N
    (4, 8, 1, None, "2 model chunks"),
    (1, 4, 2, None, "2 pipeline stages"),
    (2, 6, 2, 3, "with 2 stages"),
])
def test_config_errors_are_one_line(n: int, m: int, v: int, group: int | None, why: str) -> None:
    with pytest.raises(ScheduleConfigError) as info:
        build_schedule(NAME, config(n, m, v, group))
    assert why in str(info.value) and len(str(info.value).splitlines()) == 1, info.value


def test_other_schedules_still_refuse_chunks() -> None:
    for name in ("1f1b", "gpipe"):
        with pytest.raises(ScheduleConfigError, match="one model chunk"):
            build_schedule(name, config(2, 4, 2))


def test_two_stages_with_a_larger_group_reorders_only_across_lanes() -> None:
    """Why check_config refuses G > N for N = 2 on Megatron-LM's P2P (one FIFO per stage pair): a
    larger group sends gradients and activations between the two stages in another order than
    the receiver takes them. Here they travel in separate lanes (one FIFO and one process group
    each, ``comm.Lane``), so the replay finds every lane in order: the refusal keeps Megatron-LM's
    rule, not a deadlock of this runtime."""
    cfg = config(2, 6, 2, group=3)
    schedule = object.__new__(Interleaved1F1B)
    schedule.config = cfg  # bypass check_config
    check_streams([list(s) for s in schedule.streams()], PipelineLayout(2, 2))
    with pytest.raises(ScheduleConfigError, match="group size must be 2"):
        Interleaved1F1B.check_config(cfg)


# ------------------------------------------------------------------ (b) peak in flight


def test_peak_in_flight_follows_megatrons_warmup() -> None:
    for n in range(2, 9):
        for v in (2, 3):
            for m in range(n, 3 * n + 1, n):
                schedule = build_schedule(NAME, config(n, m, v, iterations=1))
                peaks = [peak_in_flight(s) for s in schedule.streams()]
                assert peaks == expected_peaks(n, m, v), (n, v, m)
                assert all(warmup_forwards(s, n, m, v, n) + 1 >= p for s, p in enumerate(peaks))
    # Interleaving costs memory: stage 0 holds more than 1F1B's N micro-batches' worth.
    assert expected_peaks(4, 8, 2)[0] == 11  # 11 chunks of half a stage = 5.5 micro-batches


# ------------------------------------------------------------------ trainer flags


@pytest.fixture
def no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def test_flags_derive_chunks_per_stage(no_torchrun_env: None) -> None:
    args = parse_args(["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                       "--micro-batch-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
                       "--pipeline-schedule", NAME])
    assert args.num_model_chunks == 2
    from megatron.trainer.config.run_config import schedule_config

    assert schedule_config(args).layout == PipelineLayout(2, 2)
    # K = layers per stage gives one chunk: allowed with plain schedules, changes nothing.
    args = parse_args(["--num-layers", "8", "--pipeline-model-parallel-size", "2",
                       "--num-layers-per-virtual-pipeline-stage", "4"])
    assert args.num_model_chunks == 1


BAD_FLAGS = {
    "layers-not-divisible": (["--num-layers", "6", "--pipeline-model-parallel-size", "2",
                              "--num-layers-per-virtual-pipeline-stage", "2", "--pipeline-schedule", NAME],
                             "--num-layers-per-virtual-pipeline-stage"),
    "chunks-with-1f1b": (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                          "--num-layers-per-virtual-pipeline-stage", "1"], "--pipeline-schedule interleaved-1f1b"),
    "interleaved-without-chunks": (["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                                    "--pipeline-schedule", NAME], "--num-layers-per-virtual-pipeline-stage"),
    "one-chunk": (["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
                   "--micro-batch-size", "1", "--num-layers-per-virtual-pipeline-stage", "2",
                   "--pipeline-schedule", NAME], "--num-layers-per-virtual-pipeline-stage"),
    "with-layer-split": (["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--pipeline-layer-split",
                          "2", "2", "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-schedule", NAME],
                         "--pipeline-layer-split"),
    "m-not-multiple-of-pp": (["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--global-batch-size", "3",
                              "--micro-batch-size", "1", "--num-layers-per-virtual-pipeline-stage", "1",
                              "--pipeline-schedule", NAME], "--pipeline-schedule"),
    "group-without-interleaving": (["--microbatch-group-size-per-virtual-pipeline-stage", "2"],
                                   "--microbatch-group-size-per-virtual-pipeline-stage"),
}


@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_bad_interleaving_flags_exit_2_with_one_line(case: str, capsys: pytest.CaptureFixture[str],
                                                     no_torchrun_env: None) -> None:
    argv, flag = BAD_FLAGS[case]
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and flag in err, err


def test_chunks_hold_the_layers_of_their_virtual_stages(megatron_world1: None, no_torchrun_env: None) -> None:
    from megatron.trainer.tasks.gpt import GPTTask

    config = parse_run_plan([*tiny_args(2, NAME, 2, 1), "--num-layers", "8",
                               "--num-layers-per-virtual-pipeline-stage", "2"])
    task = GPTTask()
    stages = [task.build_stage(config, s, torch.device("cpu")) for s in range(2)]
    assert [[c.layers for c in chunks] for chunks in stages] == [[range(0, 2), range(4, 6)], [range(2, 4), range(6, 8)]]
    assert [[(c.is_first, c.is_last) for c in chunks] for chunks in stages] == \
        [[(True, False), (False, False)], [(False, False), (False, True)]]
    names = [n for chunks in stages for n, _ in task.named_parameters(chunks)]
    assert len(names) == len(set(names))
    assert {int(n.split(".")[2]) for n in names if n.startswith("decoder.layers.")} == set(range(8))


# ------------------------------------------------------------------ (c), (d) training

NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
ITERS = 10
# name -> (stages, flags); m = 2N micro-batches per iteration (two groups per chunk)
RUNS = {
    "interleaved-N2": (2, [*tiny_args(2, NAME, 4, ITERS, *NO_DROPOUT), "--num-layers", "4",
                           "--num-layers-per-virtual-pipeline-stage", "1"]),
    "1f1b-N2": (2, [*tiny_args(2, "1f1b", 4, ITERS, *NO_DROPOUT), "--num-layers", "4"]),
    "interleaved-N4": (4, [*tiny_args(4, NAME, 8, ITERS, *NO_DROPOUT), "--num-layers", "8",
                           "--num-layers-per-virtual-pipeline-stage", "1"]),
    "1f1b-N4": (4, [*tiny_args(4, "1f1b", 8, ITERS, *NO_DROPOUT), "--num-layers", "8"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[dict], dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("interleaved")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run_pretrain, argv, root / name, 600) for name, (_, argv) in RUNS.items()
                   if name.startswith("interleaved")}  # the 1f1b references run in the emulator, traced
        return {name: f.result() for name, f in futures.items()}


def assert_same_training(got: tuple[list[dict], dict], want: Reference) -> None:
    """Interleaving changes where each layer's gradient sums happen, not what they sum: losses and
    parameters within the tolerances tests/adam_bounds.py derives from the reference's Adam steps."""
    records, params = got
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    assert [r["consumed_samples"] for r in records] == [r["consumed_samples"] for r in want.records]
    assert_trains_like(records, params, want, keys=("loss",))
    assert want.records[-1]["loss"] < want.records[0]["loss"]  # training moved something


@pytest.mark.parametrize("n", [2, 4])
def test_distributed_interleaved_trains_like_1f1b(n: int, runs, megatron_world1, tmp_path) -> None:
    assert_same_training(runs[f"interleaved-N{n}"], emulated_reference(RUNS[f"1f1b-N{n}"][1], tmp_path / "1f1b.jsonl"))
    m, v = 2 * n, 2
    records = runs[f"interleaved-N{n}"][0]
    assert all(r["peak_inflight_microbatches"] == expected_peaks(n, m, v) for r in records), records[0]
    assert all(r["drift_max"] == [0] * n for r in records)


def test_emulator_is_bitwise_equal_to_distributed_with_dropout(megatron_world1: None, tmp_path) -> None:
    argv = [*tiny_args(2, NAME, 4, 6, "--hidden-dropout", "0.1", "--attention-dropout", "0.1"),
            "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"]
    records, dist_params = run_pretrain(argv, tmp_path / "dist", timeout=600)
    emu_log = tmp_path / "emu.jsonl"
    threads = torch.get_num_threads()
    try:
        workers = emulate([*argv, "--pipeline-executor", "emulator", "--log-json", str(emu_log)])
    finally:
        torch.set_num_threads(threads)
    emu_records = [json.loads(line) for line in emu_log.read_text().splitlines()]
    assert [r["loss"] for r in records] == [r["loss"] for r in emu_records]
    assert [r["grad_norm"] for r in records] == [r["grad_norm"] for r in emu_records]
    emu_params = final_params(workers)
    assert dist_params.keys() == emu_params.keys()
    for name, value in dist_params.items():
        assert torch.equal(value, emu_params[name]), name
    assert [w.meter.run_peak_count for w in workers] == expected_peaks(2, 4, 2)
