"""The examples: `bash examples/pretrain_gpt_paci.sh` runs on a CPU-only machine with no arguments
(shortened, torchrun), and every per-schedule example builds its command lines and trains 2
iterations in the emulator."""
from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

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
# Every examples/pretrain_{gpt,bert}_<schedule>.sh: its command lines (dry run, CPU and an 8-GPU
# node) and a 2-iteration run of each in the emulator, all in one process (one torch import).

EXAMPLES = sorted(p.name for p in (REPO / "examples").glob("pretrain_*.sh"))
SCHEDULE_OF = {"1f1b": "1f1b", "interleaved": "interleaved-1f1b", "zb2p": "zb-2p", "async": "async-1f1b",
               "2bw": "pipedream-2bw", "pipemare": "pipemare", "amdp": "amdp", "paci": "paci"}
# Largest weight-version drift a stage may show in the CI runs (2 stages: N - 1 = 1 for the asynchronous ones).
MAX_DRIFT = {"1f1b": 0, "interleaved-1f1b": 0, "zb-2p": 0, "paci": 1, "pipemare": 1, "pipedream-2bw": 0,
             "amdp": 1, "async-1f1b": 1}


def _schedule(name: str) -> str:
    return SCHEDULE_OF[name.rsplit("_", 1)[1][:-len(".sh")]]


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


def test_every_schedule_has_a_gpt_and_a_bert_example():
    assert set(EXAMPLES) == {f"pretrain_{m}_{s}.sh" for m in ("gpt", "bert") for s in SCHEDULE_OF}


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_command_lines(name):
    schedule, model = _schedule(name), name.split("_")[1]
    cpu = _dry_run(name, FORCE_CPU="1")
    assert cpu[0] == "torchrun" and _flag(cpu, "--nproc-per-node") == "4" and _flag(cpu, "--nnodes") == "1"
    assert cpu[cpu.index("--rdzv-id") + 2] == str(REPO / f"pretrain_{model}.py")
    assert _flag(cpu, "--pipeline-schedule") == schedule
    assert _flag(cpu, "--pipeline-model-parallel-size") == "4" and "--num-threads" in cpu and "--mock-data" in cpu
    gpu = _dry_run(name, GPUS_PER_NODE="8")  # an 8-GPU node: one stage per GPU, bf16, the full-size model
    assert _flag(gpu, "--nproc-per-node") == "8" and _flag(gpu, "--pipeline-model-parallel-size") == "8"
    assert "--bf16" in gpu and _flag(gpu, "--num-layers") == "24" and _flag(gpu, "--hidden-size") == "1024"
    assert _flag(gpu, "--pipeline-schedule") == schedule
    emulated = _dry_run(name, FORCE_CPU="1", EXECUTOR="emulator", CHECKPOINT_DIR="ck", EXTRA_ARGS="--seed 7")
    assert emulated[:3] == ["python", str(REPO / f"pretrain_{model}.py"), "--pipeline-executor"]
    assert _flag(emulated, "--save") == "ck" and _flag(emulated, "--load") == "ck" and emulated[-2:] == ["--seed", "7"]


@pytest.fixture(scope="module")
def emulated_examples(tmp_path_factory):
    """Each example's 2-iteration emulator run: name -> (driver result, log records)."""
    root = tmp_path_factory.mktemp("examples")
    lines = []
    for name in EXAMPLES:  # 2 stages, 2 micro-batches (async-1f1b: its 1), 2 iterations
        small = {} if _schedule(name) == "async-1f1b" else {"MICRO_BATCHES": "2"}
        argv = _dry_run(name, FORCE_CPU="1", EXECUTOR="emulator", PP="2", TRAIN_ITERS="2", LOG_INTERVAL="1",
                        ZB_PROFILE_ITERS="1", LOG_JSON=str(root / f"{name}.jsonl"), **small)
        lines.append(" ".join(shlex.quote(a) for a in argv))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "examples_driver.py")], cwd=REPO, env=_env(),
                          input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=900)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("EXAMPLE-RESULT "):
            res = json.loads(line[len("EXAMPLE-RESULT "):])
            results[EXAMPLES[res["line"]]] = res
    return results, root, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_trains_in_the_emulator(emulated_examples, name):
    results, root, tail = emulated_examples
    assert name in results, f"the driver stopped before {name}:\n{tail}"
    res, schedule = results[name], _schedule(name)
    if res["status"] == "unregistered":
        pytest.skip(f"--pipeline-schedule {schedule} is not registered in megatron.pipeline.schedules yet")
    assert res["status"] == "ok", f"{res}\n{tail}"
    records = [json.loads(line) for line in (root / f"{name}.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert max(max(r["drift_max"]) for r in records) <= MAX_DRIFT[schedule]
