"""Interleaved 1F1B and every Zero Bubble schedule train like 1F1B-flush, end to end.

Same tiny GPT (2 layers per stage, so interleaving can run one layer per chunk), fp32,
dropout 0, m = 8 micro-batches per iteration, 10 iterations, N in {2, 4}. The reference is
1F1B-flush in the emulator (bitwise equal to the distributed runtime, tests/test_reference.py).

* The emulator runs the full matrix (fast). A schedule matches when every iteration's loss
  is within 1e-6 relative and every parameter tensor within 1e-6 relative error
  (``||got - ref|| / ||ref||``), the key slice of ``linear_qkv.bias`` excepted: its true
  gradient is exactly zero and Adam turns rounding noise there into steps of up to
  ~lr (see test_reference.py), so it is held to 5e-5 absolute, 0.5% of one peak-lr step.
* Zero Bubble schedules are in fact bit for bit equal to 1F1B in the plain variant: B + W
  is exact per micro-batch, and ZB-H1/H2 and the greedy run each stage's Bs and Ws in
  micro-batch order, so gradients accumulate in the same order. zb-1p / zb-2p run with
  fixed costs (``--zb-costs``) and with profiling on (the emulator times ops in-process,
  so their order may differ run to run; the numbers may not).
* Interleaving changes which layers share a stage, and with it how the per-stage squared
  gradient norms are grouped before the global clip norm: the clip coefficient differs in
  the last bits and ten Adam steps amplify that to a few 1e-7 (without clipping it is
  bitwise equal too).
* The distributed runtime runs two cases: zb-1p N=2 with fixed costs (bitwise equal to the
  emulator, hence to 1F1B) and zb-2p N=4 with profiling on (2 profiled ZB-H1 iterations,
  then the order searched from the gathered costs), which must match 1F1B and log its
  profiled costs once.

Every case runs under each entry of ``VARIANTS`` (runtime flags that must not change the
math); post-validation adds its flags there.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.adam_bounds import assert_within_bounds
from tests.async_helpers import REPO, TINY_GPT, Reference, emulated_reference

pytestmark = pytest.mark.usefixtures("megatron_world1")

ITERS = 10
MICROBATCHES = 8  # a multiple of N (interleaving) and >= 2N - 1 (ZB-H2's warm-up) for N = 2, 4
FIXED_COSTS = "1,1.2,0.6,0.1,0.7"  # T_F, T_B, T_W, T_comm, M_W/M_B: orders unlike ZB-H1's


@dataclass(frozen=True)
class Variant:
    flags: tuple[str, ...]
    zb_bitwise: bool  # Zero Bubble schedules must equal 1F1B bit for bit


VARIANTS: dict[str, Variant] = {
    "sync-step": Variant(flags=(), zb_bitwise=True),
}

# case id -> (schedule, extra flags, is a Zero Bubble schedule)
CASES: dict[str, tuple[str, tuple[str, ...], bool]] = {
    "interleaved-1f1b": ("interleaved-1f1b", ("--num-layers-per-virtual-pipeline-stage", "1"), False),
    "zb-h1": ("zb-h1", (), True),
    "zb-h2": ("zb-h2", (), True),
    "zb-1p-fixed": ("zb-1p", ("--zb-costs", FIXED_COSTS), True),
    "zb-2p-fixed": ("zb-2p", ("--zb-costs", FIXED_COSTS), True),
    "zb-1p-profiled": ("zb-1p", ("--zb-profile-iters", "2"), True),
    "zb-2p-profiled": ("zb-2p", ("--zb-profile-iters", "2"), True),
}

# name -> (stages, case, variant) run by the distributed runtime
DIST_CASES = {
    f"{case}-N{n}-{variant}": (n, case, variant)
    for variant in VARIANTS
    for n, case in ((2, "zb-1p-fixed"), (4, "zb-2p-profiled"))
}


def flags(num_stages: int, schedule: str, *extra: str) -> list[str]:
    return [
        *TINY_GPT, "--num-layers", str(2 * num_stages), "--pipeline-model-parallel-size", str(num_stages),
        "--pipeline-schedule", schedule, "--global-batch-size", str(MICROBATCHES),
        "--train-iters", str(ITERS), "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--clip-grad", "1.0", "--device", "cpu", *extra,
    ]


@dataclass
class Run:
    losses: list[float]
    params: dict[str, torch.Tensor]
    stdout: str = ""
    reference: Reference | None = None  # an emulator run's derived tolerances (tests/adam_bounds.py)


def _losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


_emulated: dict[tuple, Run] = {}


def emulated(tmp: Path, num_stages: int, schedule: str, extra: tuple[str, ...]) -> Run:
    """Emulator run (cached per module: the distributed comparisons reuse them)."""
    key = (num_stages, schedule, extra)
    if key not in _emulated:
        log = tmp / f"emu-{len(_emulated)}.jsonl"
        threads = torch.get_num_threads()
        try:
            ref = emulated_reference(flags(num_stages, schedule, *extra), log)
        finally:
            torch.set_num_threads(threads)
        _emulated[key] = Run([r["loss"] for r in ref.records], ref.params, reference=ref)
    return _emulated[key]


def _launch(argv: list[str], out_dir: Path) -> Run:
    """``pretrain_gpt.py`` with local ranks; JSON records, dumped parameters, stdout."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log, dump = out_dir / "log.jsonl", out_dir / "params"
    cmd = [sys.executable, str(REPO / "pretrain_gpt.py"), *argv, "--log-json", str(log), "--dump-final-params", str(dump)]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONWARNINGS"] = "ignore"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    params: dict[str, torch.Tensor] = {}
    for f in sorted(dump.glob("stage*.pt")):
        params.update(torch.load(f))
    return Run(_losses(log), params, proc.stdout)


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future]:
    """Start the distributed runs in the background, overlapping the emulator matrix."""
    root = tmp_path_factory.mktemp("zb-dist")
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {}
    for name, (n, case, variant) in DIST_CASES.items():
        schedule, extra, _ = CASES[case]
        argv = flags(n, schedule, *extra, *VARIANTS[variant].flags)
        futures[name] = pool.submit(_launch, argv, root / name)
    yield futures
    pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory: pytest.TempPathFactory, launched) -> Path:
    return tmp_path_factory.mktemp("zb-emu")


@pytest.fixture(scope="module")
def reference(emu_dir: Path):
    """1F1B-flush per stage count (the emulator; bitwise the distributed runtime's numbers)."""
    return {n: emulated(emu_dir, n, "1f1b", ()) for n in (2, 4)}


def assert_trains_like(run: Run, ref: Run, num_stages: int, bitwise: bool) -> None:
    """Another order of the same sums than 1F1B's (interleaving, B/W split, profiling): losses
    within ``rho`` relative, every parameter element within the bound tests/adam_bounds.py derives
    from the 1F1B run's own Adam steps; Zero Bubble's schedules must moreover be bitwise."""
    assert len(run.losses) == len(ref.losses) == ITERS
    for it, (a, b) in enumerate(zip(run.losses, ref.losses), 1):
        assert math.isclose(a, b, rel_tol=ref.reference.rho), (it, a, b)
    assert_within_bounds(run.params, ref.params, ref.reference.bounds, context=f"N={num_stages}: ")
    if bitwise:
        assert run.losses == ref.losses
        for name, expected in ref.params.items():
            assert torch.equal(run.params[name], expected), name


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("num_stages", [2, 4])
def test_emulator_trains_like_1f1b(num_stages: int, case: str, variant: str, reference, emu_dir: Path) -> None:
    schedule, extra, is_zb = CASES[case]
    run = emulated(emu_dir, num_stages, schedule, (*extra, *VARIANTS[variant].flags))
    assert_trains_like(run, reference[num_stages], num_stages, bitwise=is_zb and VARIANTS[variant].zb_bitwise)


@pytest.mark.parametrize("name", list(DIST_CASES))
def test_distributed_trains_like_1f1b(name: str, launched, reference, emu_dir: Path) -> None:
    n, case, variant = DIST_CASES[name]
    schedule, extra, _ = CASES[case]
    run = launched[name].result()
    assert_trains_like(run, reference[n], n, bitwise=False)
    described = [line for line in run.stdout.splitlines() if "zero-bubble-schedule {" in line]
    assert len(described) == 1, run.stdout[-3000:]  # logged once, by rank 0
    info = json.loads(described[0].split("zero-bubble-schedule ", 1)[1])
    assert info["schedule"] == schedule and info["num_stages"] == n and len(info["costs"]) == n
    if "--zb-costs" in extra:
        # Fixed costs: the same order as the emulator's, hence the very same numbers.
        emu = emulated(emu_dir, n, schedule, (*extra, *VARIANTS[variant].flags))
        assert run.losses == emu.losses
        for key, value in emu.params.items():
            assert torch.equal(run.params[key], value), key
        assert info["profile_iters"] == 0
    else:
        assert info["profile_iters"] == 2
        for c in info["costs"]:  # measured: positive times, a ratio in (0, 1]
            assert c["t_f"] > 0 and c["t_b"] > 0 and c["t_w"] >= 0 and c["t_comm"] >= 0 and 0 < c["m_w"] <= 1
        assert max(info["chosen"]["peak_memory"]) <= 2 * n + 1e-9
