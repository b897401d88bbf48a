"""The examples: `bash examples/pretrain_gpt_paci.sh` runs on a CPU-only machine with no arguments
(shortened, torchrun); every schedule of the registry (``megatron.pipeline.schedules.SCHEDULES``)
has a GPT and a BERT example, and the schedule tables of README.md and docs/schedules.md list
every registered schedule; every example builds its command lines and trains 2 iterations in the
emulator.

Nothing here names a schedule: the registry says which schedules exist, and each example script
says which schedule it runs (its ``SCHEDULE="${SCHEDULE:-NAME}"`` default line, the same line
``example_script`` in examples/common.sh looks for)."""
from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.pipeline.schedules import schedule_class
from megatron.pipeline.schedules.v_shape.layout import VShapeSchedule
from megatron.pipeline.schedules import ScheduleConfig

REPO = Path(__file__).resolve().parent.parent


def test_paci_example_runs_on_cpu(tmp_path):
    log = tmp_path / "log.jsonl"
    env = dict(os.environ, FORCE_CPU="1", TRAIN_ITERS="6", LOG_INTERVAL="2", LOG_JSON=str(log),
               MASTER_PORT=str(29000 + os.getpid() % 1000), PYTHONWARNINGS="ignore")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        env.pop(var, None)
    proc = subprocess.run(["bash", "examples/pretrain_gpt_paci.sh"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [2, 4, 6]
    assert all(math.isfinite(r["loss"]) for r in records)
    # PACI with the CPU defaults: 4 stages, a = 4 -> drift bound ceil((N-1-s)/a) = [1, 1, 1, 0].
    assert max(max(r["drift_max"][s] for r in records) for s in range(4)) <= 1
    assert all(r["drift_max"][3] == 0 for r in records)


# ---------------------------------------------------------------------------------------------
# Every examples/pretrain_{gpt,bert}_<schedule>.sh against the registry: one per model and
# registered schedule, its command lines (dry run, CPU and an 8-GPU node) and a 2-iteration run of
# each in the emulator, all in one process (one torch import).

MODELS = ("gpt", "bert")
EXAMPLES = sorted(p.name for p in (REPO / "examples").glob("pretrain_*.sh"))
_DEFAULT_LINE = re.compile(r'^SCHEDULE="\$\{SCHEDULE:-([^}]*)\}"$', re.MULTILINE)
CI_STAGES = 2  # the emulator runs: 2 stages, at most 2 micro-batches, 2 iterations


def _model(name: str) -> str:
    return name.split("_")[1]


def _schedule(name: str) -> str:
    """The schedule example ``name`` runs by default, read from the script itself."""
    defaults = _DEFAULT_LINE.findall((REPO / "examples" / name).read_text())
    assert len(defaults) == 1, f'examples/{name}: needs exactly one SCHEDULE="${{SCHEDULE:-NAME}}" line'
    return defaults[0]


def _registry() -> dict[str, type]:
    from megatron.pipeline.schedules import SCHEDULES

    return SCHEDULES


def example_coverage_errors() -> list[str]:
    """What is wrong between the registry and the example scripts (empty: nothing): a registered
    schedule without a script for a model, two scripts for one, a script for an unknown schedule."""
    registry = _registry()
    scripts: dict[tuple[str, str], list[str]] = {}
    for name in EXAMPLES:
        scripts.setdefault((_model(name), _schedule(name)), []).append(name)
    errors = [f"no examples/pretrain_{model}_*.sh runs --pipeline-schedule {schedule}"
              for schedule in registry for model in MODELS if (model, schedule) not in scripts]
    errors += [f"{', '.join(names)} all run {schedule}" for (_, schedule), names in scripts.items() if len(names) > 1]
    errors += [f"{names[0]} runs {schedule}, which is not registered" for (_, schedule), names in scripts.items()
               if schedule not in registry]
    return errors


def test_every_registered_schedule_has_a_gpt_and_a_bert_example():
    assert example_coverage_errors() == []


def test_a_schedule_without_an_example_fails_the_coverage_check(monkeypatch):
    """The check above can fail: a schedule registered without examples is reported per model."""
    registry = _registry()
    base = next(iter(registry.values()))
    monkeypatch.setitem(registry, "no-example", type("NoExample", (base,), {"name": "no-example"}))
    assert example_coverage_errors() == [f"no examples/pretrain_{m}_*.sh runs --pipeline-schedule no-example"
                                         for m in MODELS]


def _table_rows(path: Path, header: str) -> dict[str, list[str]]:
    """The markdown table under the line starting with ``header``: first-cell `names` -> the row's cells."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows: dict[str, list[str]] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name in re.findall(r"`([^`]+)`", cells[0]):
            assert name not in rows, f"{path.name}: {name} has two rows"
            rows[name] = cells
    return rows


def test_readme_schedule_table_lists_every_registered_schedule():
    rows = _table_rows(REPO / "README.md", "| `--pipeline-schedule` |")
    assert set(rows) == set(_registry())


def test_schedules_guide_names_each_schedules_example():
    """docs/schedules.md has a row per registered schedule whose last cell names its examples."""
    rows = _table_rows(REPO / "docs" / "schedules.md", "| `--pipeline-schedule` |")
    assert set(rows) == set(_registry())
    for name in EXAMPLES:
        cell = rows.get(_schedule(name), ["(no row)"])[-1]
        pattern = re.findall(r"`([^`]+)`", cell)
        assert len(pattern) == 1 and fnmatch.fnmatch(name, pattern[0]), f"{name}: docs/schedules.md says {cell}"


def _env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "GPUS_PER_NODE",
        "PP", "DP", "SCHEDULE", "TRAIN_ITERS", "MICRO_BATCHES", "DATA_PATH", "CHECKPOINT_DIR", "EXECUTOR",
        "DRY_RUN", "EXTRA_ARGS", "LOG_JSON", "FORCE_CPU")}
    env.update(PYTHONWARNINGS="ignore", **overrides)
    return env


def _dry_run(name: str, **overrides: str) -> list[str]:
    proc = subprocess.run(["bash", f"examples/{name}"], cwd=REPO, env=_env(DRY_RUN="1", **overrides),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return shlex.split(proc.stdout.strip().splitlines()[-1])


def _flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} appears {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


def _microbatches(argv: list[str]) -> int:
    """Micro-batches per update and replica of a command line (DP = 1: the emulator's)."""
    return int(_flag(argv, "--global-batch-size")) // int(_flag(argv, "--micro-batch-size"))


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_command_lines(name):
    schedule, model = _schedule(name), _model(name)
    cpu = _dry_run(name, FORCE_CPU="1")
    assert cpu[0] == "torchrun" and _flag(cpu, "--nproc-per-node") == "4" and _flag(cpu, "--nnodes") == "1"
    assert cpu[cpu.index("--rdzv-id") + 2] == str(REPO / f"pretrain_{model}.py")
    assert _flag(cpu, "--pipeline-schedule") == schedule
    assert _flag(cpu, "--pipeline-model-parallel-size") == "4" and "--num-threads" in cpu and "--mock-data" in cpu
    gpu = _dry_run(name, GPUS_PER_NODE="8")  # an 8-GPU node: one stage per GPU, bf16, the full-size model
    assert _flag(gpu, "--nproc-per-node") == "8" and _flag(gpu, "--pipeline-model-parallel-size") == "8"
    # GPT-2 medium's 24 layers; a V schedule splits them into 2 x 8 parts, so its example takes the
    # next multiple of 16 (32).
    layers = "32" if issubclass(schedule_class(schedule), VShapeSchedule) else "24"
    assert "--bf16" in gpu and _flag(gpu, "--num-layers") == layers and _flag(gpu, "--hidden-size") == "1024"
    assert _flag(gpu, "--pipeline-schedule") == schedule
    emulated = _dry_run(name, FORCE_CPU="1", EXECUTOR="emulator", CHECKPOINT_DIR="ck", EXTRA_ARGS="--seed 7")
    assert emulated[:3] == ["python", str(REPO / f"pretrain_{model}.py"), "--pipeline-executor"]
    assert _flag(emulated, "--save") == "ck" and _flag(emulated, "--load") == "ck" and emulated[-2:] == ["--seed", "7"]


def test_example_script_finds_each_examples_schedule():
    """examples/common.sh's example_script (the Slurm scripts' SCHEDULE -> script) agrees with the
    scripts' own defaults, and refuses a schedule without one."""
    pairs = [(_model(name), _schedule(name)) for name in EXAMPLES]
    script = 'source examples/common.sh; while [ $# -gt 0 ]; do example_script "$1" "$2"; shift 2; done'
    proc = subprocess.run(["bash", "-c", script, "bash", *(w for pair in pairs for w in pair)], cwd=REPO,
                          env=_env(FORCE_CPU="1"), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert [Path(p).name for p in proc.stdout.split()] == EXAMPLES
    proc = subprocess.run(["bash", "-c", "source examples/common.sh; example_script gpt no-example"], cwd=REPO,
                          env=_env(FORCE_CPU="1"), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no example script" in proc.stderr


def _emulator_argv(name: str, log: Path) -> list[str]:
    """The example's CPU command line for the emulator, shrunk: CI_STAGES stages, 2 iterations and
    at most 2 micro-batches (fewer where the script's default is fewer, e.g. async-1f1b's 1)."""
    small = dict(FORCE_CPU="1", EXECUTOR="emulator", PP=str(CI_STAGES), TRAIN_ITERS="2", LOG_INTERVAL="1",
                 ZB_PROFILE_ITERS="1", LOG_JSON=str(log))
    argv = _dry_run(name, **small)
    least = max(2, getattr(_registry()[_schedule(name)], "min_microbatches_per_stage", 1) * CI_STAGES)
    if _microbatches(argv) > least:  # not below what the schedule needs (DualPipeV: 2N)
        argv = _dry_run(name, MICRO_BATCHES=str(least), **small)
    return argv


@pytest.fixture(scope="module")
def emulated_examples(tmp_path_factory):
    """Each example's 2-iteration emulator run: name -> (driver result, log records)."""
    root = tmp_path_factory.mktemp("examples")
    lines = [" ".join(shlex.quote(a) for a in _emulator_argv(name, root / f"{name}.jsonl")) for name in EXAMPLES]
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "examples_driver.py")], cwd=REPO, env=_env(),
                          input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=900)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("EXAMPLE-RESULT "):
            res = json.loads(line[len("EXAMPLE-RESULT "):])
            results[EXAMPLES[res["line"]]] = res
    return results, root, proc.stdout[-3000:] + proc.stderr[-3000:]


def _drift_bound(schedule: str) -> int:
    """Largest weight-version drift a stage may show with CI_STAGES stages: none for a synchronous
    schedule or one that stashes weights (backward reads its forward's version), N - 1 otherwise."""
    cls = _registry()[schedule]
    return 0 if not cls.traits.asynchronous or cls.traits.policy_for(ScheduleConfig(CI_STAGES, CI_STAGES)).stashes_weights else CI_STAGES - 1


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_trains_in_the_emulator(emulated_examples, name):
    results, root, tail = emulated_examples
    assert name in results, f"the driver stopped before {name}:\n{tail}"
    res, schedule = results[name], _schedule(name)
    assert res["status"] == "ok", f"{res}\n{tail}"  # "unregistered" fails too: a script for no schedule
    records = [json.loads(line) for line in (root / f"{name}.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert max(max(r["drift_max"]) for r in records) <= _drift_bound(schedule)
