"""The GPU check (issue 29, ``benchmarks/gpu_check.py``) and its wheelhouse
(``tools/make_wheelhouse.sh``), on CPU: the dry run of every step, the wheel listing and tag
rules without network, the install selection and the FLOP count behind MFU."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

from benchmarks.gpucheck.flops import GPTShape, flops_per_token, mfu  # noqa: E402
from benchmarks.gpucheck.wheels import wheels_to_install  # noqa: E402
from tools.wheelhouse import Target, project_requirements, second_phase  # noqa: E402

STEPS = ["environment", "gpu_tests", "schedules", "throughput", "memory", "distributed"]
# The dry run needs about 62 s of CPU (its steps' child processes); alone on 2 cores it ends within
# the 2 minutes. Under `pytest -n 2` another worker shares the cores, so the driver gets
# twice that as its budget: the steps are not cut short by a neighbour, and a hang still ends.
DRY_RUN_BUDGET_S = 240


def test_cpu_dry_run_runs_every_step(tmp_path: Path):
    """Every step runs on CPU at tiny sizes and passes its own check within the budget; the
    JSON has one entry per step with its status and figures, the markdown one row per step."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--cpu-dry-run", "--out", str(tmp_path),
                           "--budget-s", str(DRY_RUN_BUDGET_S)], cwd=REPO, capture_output=True, text=True,
                          timeout=DRY_RUN_BUDGET_S + 60)
    elapsed = time.monotonic() - start
    report = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert list(report) == ["install", *STEPS], proc.stdout
    statuses = {name: report[name]["status"] for name in STEPS}
    assert statuses == dict.fromkeys(STEPS, "pass"), (statuses, proc.stdout, proc.stderr[-2000:])
    assert proc.returncode == 0 and elapsed < DRY_RUN_BUDGET_S + 10
    assert all(report[name]["figures"] for name in STEPS)
    assert set(report["schedules"]["figures"]["bf16"].values()) == {"falling"}
    assert report["distributed"]["figures"]["max_rel_loss_diff"] == 0.0  # CPU ranks == emulator, bitwise
    rows = [line for line in (tmp_path / "gpu_check.md").read_text().splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0][2:] for r in rows[1:]] == ["install", *STEPS]


def test_wheelhouse_list_names_and_tags_for_312():
    """``--list`` (no network): phase 1 is the project's dependencies without torch, pinned
    megatron-core included; the pip flags ask for CPython 3.12 manylinux x86_64 wheels only."""
    out = subprocess.run(["bash", "tools/make_wheelhouse.sh", "unused", "--python", "3.12", "--list"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    phase1 = out.splitlines()[0].split(":", 1)[1].split()
    assert "megatron-core==0.16.1" in phase1 and {"nltk", "regex"} <= set(phase1)
    assert any(r.startswith("tokenizers") for r in phase1) and not any(r.startswith("torch") for r in phase1)
    flags = out.split("pip flags:", 1)[1].split()
    assert "--only-binary=:all:" in flags
    assert flags[flags.index("--python-version") + 1] == "3.12" and flags[flags.index("--abi") + 1] == "cp312"
    platforms = [flags[i + 1] for i, f in enumerate(flags) if f == "--platform"]
    assert "manylinux2014_x86_64" in platforms and all(p == "any" or p.endswith("_x86_64") for p in platforms)


@pytest.mark.parametrize("filename, ok", [
    ("megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", True),
    ("megatron_core-0.16.1-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl", False),
    ("tokenizers-0.23.3-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", True),
    ("tokenizers-0.23.3-cp313-abi3-manylinux_2_17_x86_64.whl", False),
    ("nltk-3.10.4-py3-none-any.whl", True),
    ("regex-2026.11.19-cp312-cp312-macosx_11_0_arm64.whl", False),
    ("numpy-2.5.5-cp312-cp312-manylinux_2_27_aarch64.whl", False),
])
def test_wheel_tags_for_312(filename: str, ok: bool):
    assert Target("3.12").accepts(filename) is ok


def test_torch_dependents_are_replaced_by_their_other_requirements():
    """megatron-core requires torch, so phase 2 downloads its other requirements instead of it
    (pip would resolve torch); a torch-free requirement stays as it is."""
    first = [r for r in project_requirements() if r.name in ("megatron-core", "nltk")]
    metadata = {"megatron-core": "Requires-Dist: torch>=2.6.0\nRequires-Dist: numpy\nRequires-Dist: packaging>=24.2\n"
                                 'Requires-Dist: tqdm; extra == "dev"\nRequires-Dist: pywin32; sys_platform == "win32"\n',
                "nltk": "Requires-Dist: regex>=2021.8.3\n"}
    assert second_phase(first, metadata, Target("3.12")) == ["nltk", "numpy", "packaging>=24.2"]


def test_install_keeps_the_images_packages_but_not_a_wrong_megatron_core():
    wheels = [Path(n) for n in ("megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl",
                                "numpy-2.4.0-cp312-cp312-manylinux_2_28_x86_64.whl", "nltk-3.10.4-py3-none-any.whl")]
    image = {"numpy": "2.5.2", "megatron-core": "0.15.0"}
    todo, kept = wheels_to_install(wheels, installed=image.get)
    assert [w.name.split("-")[0] for w in todo] == ["megatron_core", "nltk"] and kept == ["numpy 2.5.2"]


@pytest.mark.usefixtures("megatron_world1")
def test_flops_are_megatron_lms_count():
    """Our count against the trainer's ``flops_per_iteration`` (written independently, without
    the causal halving of the attention): they differ by exactly the halved term, 6 * L * s * h
    per token; and GPT-2 medium's count per token is 6 x parameters plus the attention term."""
    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.config.megatron_compat_args import flops_per_iteration

    m = GPTShape(layers=3, hidden=64, heads=4, seq=32, vocab=256)
    config = parse_run_plan(["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
                               "--seq-length", "32", "--vocab-size", "256", "--pipeline-executor", "emulator"],
                              build_parser())
    trainer_per_token = flops_per_iteration(config, 1) / m.seq
    assert trainer_per_token - flops_per_token(m) == pytest.approx(6 * m.layers * m.seq * m.hidden, rel=1e-12)
    medium = GPTShape(24, 1024, 16, 1024, 50304)
    weights = 24 * 12 * 1024**2 + 1024 * 50304  # the GEMMs' weights (no biases, norms, embeddings)
    assert flops_per_token(medium) == 6 * weights + 6 * 24 * 1024 * 1024
    assert mfu(1000.0, medium, 989.0) == pytest.approx(1000.0 * flops_per_token(medium) / 989e12)
    assert mfu(1000.0, medium, None) is None
