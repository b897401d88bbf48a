"""examples/slurm/*.sbatch under fake `srun`, `scontrol` and `torchrun` executables.

The fakes record their argv and environment; the fake srun starts its command once per task
(--ntasks-per-node per node) with SLURM_NODEID / SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS
set, as Slurm does. The batch scripts run from a copy outside the repository (sbatch runs a
spooled copy), so they must find the repository through SLURM_SUBMIT_DIR. Covered: one torchrun
per node, one srun task per GPU (each a rank; the trainer's SLURM_* translation is tested on
its own and with two real ranks), pyxis container flags, the USR1-save-requeue path, and the
refusals (mock data, topology, GPUs).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.pipeline.schedules import SCHEDULES as REGISTERED_SCHEDULES
from megatron.trainer.launch.slurm_env import adopt_slurm_task_environment, tasks_on_this_node

REPO = Path(__file__).resolve().parent.parent
SLURM = REPO / "examples" / "slurm"

FAKE_RECORDER = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({{"prog": os.path.basename(sys.argv[0]), "argv": sys.argv[1:],
                         "env": {{k: v for k, v in os.environ.items()
                                 if k.startswith(("SLURM_", "NODE_RANK", "MASTER_", "NNODES", "GPUS_PER_NODE", "TORCH",
                                                  "NCCL_", "CUDA_DEVICE_MAX", "LAUNCH"))}}}}) + "\\n")
"""

FAKE_SCONTROL = FAKE_RECORDER + """
if sys.argv[1:3] == ["show", "hostnames"]:
    print("\\n".join(os.environ["FAKE_HOSTS"].split()))
elif sys.argv[1:2] != ["requeue"]:
    sys.exit("fake scontrol: unexpected arguments %r" % sys.argv[1:])
"""

# Run the command once per task (sequentially) with Slurm's per-task variables. With
# FAKE_SRUN_WAIT_SIGNAL=FILE it then writes FILE and waits for the USR1/TERM the batch script
# passes on (blocked first, so none is lost), and records it.
FAKE_SRUN = FAKE_RECORDER + """
import signal, subprocess
args = sys.argv[1:]
opts = {}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    opts[key] = value
nodes, per_node = int(opts["nodes"]), int(opts["ntasks-per-node"])
for node in range(nodes):
    for local in range(per_node):
        env = dict(os.environ, SLURM_PROCID=str(node * per_node + local), SLURM_LOCALID=str(local),
                   SLURM_NTASKS=str(nodes * per_node), SLURM_STEP_ID="0")
        if os.environ.get("FAKE_SRUN_NO_NODEID") == "1":
            env.pop("SLURM_NODEID", None)
        else:
            env["SLURM_NODEID"] = str(node)
        rc = subprocess.call(args, env=env)
        if rc:
            sys.exit(rc)
if os.environ.get("FAKE_SRUN_WAIT_SIGNAL"):
    wanted = {signal.SIGUSR1, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, wanted)
    with open(os.environ["FAKE_SRUN_WAIT_SIGNAL"], "w") as f:
        f.write(str(os.getpid()))
    got = signal.sigwait(wanted)
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps({"prog": "srun", "argv": [], "env": {}, "signal": signal.Signals(got).name}) + "\\n")
"""


def _fakes(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torchrun = FAKE_RECORDER + "sys.exit(int(os.environ.get('FAKE_TORCHRUN_EXIT', '0')))\n"  # a failed step
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("torchrun", torchrun),
                       ("python", FAKE_RECORDER)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def start_batch(tmp_path: Path, script: str, hosts: list[str], **env_overrides: str) -> subprocess.Popen:
    """Start a copy of examples/slurm/SCRIPT in a fake allocation (mock data unless DATA_PATH)."""
    bin_dir = _fakes(tmp_path)
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(SLURM / script, spool / "slurm_script")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "TORCH_ELASTIC_", "CONTAINER_")) and k not in (
               "NODES", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "PP", "DP",
               "SCHEDULE", "MODEL", "EXAMPLE", "CHECKPOINT_DIR", "TRAIN_ITERS", "MICRO_BATCHES", "DATA_PATH",
               "FORCE_CPU", "EXECUTOR", "DRY_RUN", "EXTRA_ARGS", "REPO_DIR", "LOG_JSON", "MOCK_DATA", "LAUNCHER",
               "LAUNCH_EXEC", "EXIT_SIGNAL", "EXIT_CHECK_INTERVAL", "REQUEUE", "SAVE_INTERVAL",
               "MAX_RESTARTS", "MAX_REQUEUES", "RDZV_BACKEND")}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_LOG=str(tmp_path / "calls.jsonl"),
        FAKE_HOSTS=" ".join(hosts), SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=f"gpu[{hosts[0][3:]}-{hosts[-1][3:]}]",
        SLURM_JOB_NUM_NODES=str(len(hosts)), SLURM_NNODES=str(len(hosts)), SLURM_SUBMIT_DIR=str(REPO),
        SLURM_GPUS_ON_NODE="8", LOG_JSON=str(tmp_path / "log.jsonl"),
    )
    if "DATA_PATH" not in env_overrides:
        env["MOCK_DATA"] = "1"
    env.update(env_overrides)
    return subprocess.Popen(["bash", str(spool / "slurm_script")], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def records_of(tmp_path: Path) -> dict[str, list[dict]]:
    """What the fakes recorded, by program."""
    log = tmp_path / "calls.jsonl"
    records: dict[str, list[dict]] = {"srun": [], "scontrol": [], "torchrun": [], "python": []}
    if log.exists():
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            records[rec["prog"]].append(rec)
    return records


def run_batch(tmp_path: Path, script: str, hosts: list[str], **env_overrides: str):
    """Run a copy of examples/slurm/SCRIPT in a fake allocation; return (proc, records by prog)."""
    proc = start_batch(tmp_path, script, hosts, **env_overrides)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), records_of(tmp_path)


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} appears {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


def trainer_args(argv: list[str]) -> list[str]:
    scripts = [i for i, a in enumerate(argv) if a.endswith((".py"))]
    assert len(scripts) == 1, argv
    return argv[scripts[0]:]


HOSTS4 = ["gpu07", "gpu08", "gpu09", "gpu10"]


def test_four_nodes_one_torchrun_per_node(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc, rec = run_batch(tmp_path, "pretrain.sbatch", HOSTS4, SCHEDULE="zb-2p", CHECKPOINT_DIR=str(ckpt),
                          TRAIN_ITERS="77", DATA_PATH="0.7 /data/a_text_document 0.3 /data/b_text_document",
                          VOCAB_FILE="/tok/vocab.json", MERGE_FILE="/tok/merges.txt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["argv"][:3] for r in rec["scontrol"]] == [["show", "hostnames", "gpu[07-10]"]]
    assert len(rec["srun"]) == 1
    assert "--nodes=4" in rec["srun"][0]["argv"] and "--ntasks-per-node=1" in rec["srun"][0]["argv"]
    runs = rec["torchrun"]
    assert len(runs) == 4
    assert sorted(int(flag(r["argv"], "--node-rank")) for r in runs) == [0, 1, 2, 3]
    for r in runs:
        argv = r["argv"]
        assert flag(argv, "--node-rank") == r["env"]["SLURM_NODEID"]
        assert flag(argv, "--nnodes") == "4"
        assert flag(argv, "--nproc-per-node") == "8"
        host, port = flag(argv, "--rdzv-endpoint").split(":")
        assert host == "gpu07" and 1024 < int(port) < 65536
        assert flag(argv, "--rdzv-backend") == "static" and flag(argv, "--rdzv-id") == "4242"
        train = trainer_args(argv)
        assert train[0] == str(REPO / "pretrain_gpt.py")
        assert flag(train, "--pipeline-schedule") == "zb-2p"
        assert "--zb-profile-iters" in train and "--enable-optimizer-post-validation" in train
        # A pipeline per node (PP = GPUs per node), data parallel across nodes: 8 x 4 ranks.
        assert flag(train, "--pipeline-model-parallel-size") == "8"
        assert int(flag(train, "--global-batch-size")) == 4 * 8 * 4  # MBS x m x DP
        assert flag(train, "--save") == str(ckpt) and flag(train, "--load") == str(ckpt)
        assert flag(train, "--train-iters") == "77"
        assert "--bf16" in train
        i = train.index("--data-path")
        assert train[i + 1:i + 5] == ["0.7", "/data/a_text_document", "0.3", "/data/b_text_document"]
        assert flag(train, "--tokenizer-type") == "GPT2BPETokenizer"
        assert flag(train, "--vocab-file") == "/tok/vocab.json" and flag(train, "--merge-file") == "/tok/merges.txt"
    assert ckpt.is_dir()  # created up front: --load on an empty directory starts fresh


def test_one_node_through_the_multinode_script(tmp_path):
    proc, rec = run_batch(tmp_path, "pretrain.sbatch", ["gpu03"], NODES="1", MODEL="bert", SCHEDULE="1f1b",
                          CHECKPOINT_DIR=str(tmp_path / "c"), GPUS_PER_NODE="4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--nodes=1" in rec["srun"][0]["argv"]
    (run,) = rec["torchrun"]
    argv = run["argv"]
    assert (flag(argv, "--nnodes"), flag(argv, "--node-rank"), flag(argv, "--nproc-per-node")) == ("1", "0", "4")
    assert flag(argv, "--rdzv-endpoint").startswith("gpu03:")
    train = trainer_args(argv)
    assert train[0].endswith("pretrain_bert.py")
    assert flag(train, "--pipeline-schedule") == "1f1b"
    assert flag(train, "--pipeline-model-parallel-size") == "4"


def test_node_rank_falls_back_to_procid(tmp_path):
    proc, rec = run_batch(tmp_path, "pretrain.sbatch", HOSTS4[:2], CHECKPOINT_DIR=str(tmp_path / "c"),
                          FAKE_SRUN_NO_NODEID="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = rec["torchrun"]
    assert [flag(r["argv"], "--node-rank") for r in runs] == [r["env"]["SLURM_PROCID"] for r in runs] == ["0", "1"]
    assert all("SLURM_NODEID" not in r["env"] for r in runs)
    assert all(flag(trainer_args(r["argv"]), "--pipeline-schedule") == "paci" for r in runs)


def test_amdp_spans_all_nodes_as_one_pipeline_group(tmp_path):
    proc, rec = run_batch(tmp_path, "pretrain.sbatch", HOSTS4, SCHEDULE="amdp", CHECKPOINT_DIR=str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in rec["torchrun"]:
        train = trainer_args(r["argv"])
        assert flag(r["argv"], "--nproc-per-node") == "8"
        assert flag(train, "--pipeline-model-parallel-size") == "32"
        assert int(flag(train, "--global-batch-size")) == 4 * 32  # DP = 1, m = D


SCHEDULES = sorted(REGISTERED_SCHEDULES)  # every registered schedule: SCHEDULE=<name> must find its script


def test_every_schedule_has_a_script_for_the_batch_scripts():
    """SCHEDULE=<name> picks examples/pretrain_<model>_<short>.sh, whose default is that schedule."""
    script = 'source examples/common.sh; for s in "$@"; do example_script gpt "$s"; example_script bert "$s"; done'
    proc = subprocess.run(["bash", "-c", script, "bash", *SCHEDULES], cwd=REPO, capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], "GPUS_PER_NODE": "8"}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    paths = proc.stdout.split()
    assert len(paths) == 2 * len(SCHEDULES)
    for schedule, (gpt, bert) in zip(SCHEDULES, zip(paths[::2], paths[1::2])):
        for path in (gpt, bert):
            assert f'SCHEDULE="${{SCHEDULE:-{schedule}}}"' in Path(path).read_text(), path


def test_single_node_script_runs_torchrun_without_srun(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc, rec = run_batch(tmp_path, "pretrain_single_node.sbatch", ["gpu05"], SCHEDULE="pipedream-2bw",
                          CHECKPOINT_DIR=str(ckpt), TRAIN_ITERS="10", SAVE_INTERVAL="5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert rec["srun"] == []
    (run,) = rec["torchrun"]
    argv = run["argv"]
    assert (flag(argv, "--nnodes"), flag(argv, "--node-rank"), flag(argv, "--nproc-per-node")) == ("1", "0", "8")
    assert flag(argv, "--rdzv-endpoint").startswith("127.0.0.1:")
    train = trainer_args(argv)
    assert flag(train, "--pipeline-schedule") == "pipedream-2bw"
    assert (flag(train, "--save"), flag(train, "--load"), flag(train, "--save-interval")) == (str(ckpt), str(ckpt), "5")


@pytest.mark.parametrize("overrides, message", [
    ({"NODES": "8"}, "NODES=8 but the allocation has 4 host(s)"),
    ({"PP": "3", "DP": "1"}, "do not split over NNODES=4"),
    ({"SCHEDULE": "no-such-schedule"}, "no example script for schedule no-such-schedule"),
])
def test_bad_topology_fails_without_starting_torchrun(tmp_path, overrides, message):
    proc, rec = run_batch(tmp_path, "pretrain.sbatch", HOSTS4, CHECKPOINT_DIR=str(tmp_path / "c"), **overrides)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert rec["torchrun"] == []


# ------------------------------------------------------------------ what a cluster job adds

def test_both_scripts_ask_for_the_signal_and_requeue():
    for script in ("pretrain.sbatch", "pretrain_single_node.sbatch"):
        header = [line for line in (SLURM / script).read_text().splitlines() if line.startswith("#SBATCH")]
        assert "#SBATCH --signal=B:USR1@120" in header and "#SBATCH --requeue" in header, script


def test_job_environment_defaults(tmp_path):
    proc, rec = run_batch(tmp_path, "pretrain.sbatch", HOSTS4[:2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in rec["torchrun"]:
        env = r["env"]
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
        # torchrun passes the exit signal on to its workers instead of dying of it
        assert "SIGUSR1" in env["TORCHELASTIC_SIGNALS_TO_HANDLE"].split(",")
        assert 0 < int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < 120
        train = trainer_args(r["argv"])
        assert "--exit-signal-handler" in train and flag(train, "--exit-signal") == "SIGUSR1"
        assert flag(train, "--save") == flag(train, "--load")
        assert "--mock-data" in train
        assert "--exit-check-interval" not in train  # only when asked: it adds drains to asynchronous schedules


def test_exit_check_interval_reaches_the_trainer(tmp_path):
    proc, rec = run_batch(tmp_path, "pretrain.sbatch", HOSTS4[:1], EXIT_CHECK_INTERVAL="5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert flag(trainer_args(rec["torchrun"][0]["argv"]), "--exit-check-interval") == "5"


@pytest.mark.parametrize("script", ["pretrain.sbatch", "pretrain_single_node.sbatch"])
def test_usr1_before_the_time_limit_reaches_the_step_then_the_job_is_requeued(tmp_path, script):
    started = tmp_path / "step_started"
    ckpt = tmp_path / "ckpt"
    overrides = dict(CHECKPOINT_DIR=str(ckpt), FAKE_SRUN_WAIT_SIGNAL=str(started))
    if script == "pretrain_single_node.sbatch":  # its step runs in srun only with a container
        overrides["CONTAINER_IMAGE"] = "nvcr.io#nvidia/pytorch:25.09-py3"
    proc = start_batch(tmp_path, script, HOSTS4[:2] if script == "pretrain.sbatch" else ["gpu01"], **overrides)
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), proc.communicate(timeout=10)
        os.kill(proc.pid, signal.SIGUSR1)  # what --signal=B:USR1@120 does
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    rec = records_of(tmp_path)
    assert [r["signal"] for r in rec["srun"] if "signal" in r] == ["SIGUSR1"]
    assert [r["argv"] for r in rec["scontrol"] if r["argv"][:1] == ["requeue"]] == [["requeue", "4242"]]
    assert "requeueing job 4242" in err
    for r in rec["torchrun"]:  # the requeued job reruns these: --load resumes from the checkpoint
        train = trainer_args(r["argv"])
        assert flag(train, "--load") == flag(train, "--save") == str(ckpt)
        assert "--exit-signal-handler" in train


def test_scancel_term_is_passed_on_without_a_requeue(tmp_path):
    started = tmp_path / "step_started"
    proc = start_batch(tmp_path, "pretrain.sbatch", HOSTS4[:1], CHECKPOINT_DIR=str(tmp_path / "c"),
                       FAKE_SRUN_WAIT_SIGNAL=str(started))
    try:
        deadline = time.monotonic() + 60
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rec = records_of(tmp_path)
    assert [r["signal"] for r in rec["srun"] if "signal" in r] == ["SIGTERM"]
    assert not [r for r in rec["scontrol"] if r["argv"][:1] == ["requeue"]]


def test_pyxis_container_flags(tmp_path):
    proc, rec = run_batch(tmp_path, "pretrain.sbatch", HOSTS4[:2], CHECKPOINT_DIR=str(tmp_path / "c"),
                          CONTAINER_IMAGE="/shared/megatron-async.sqsh", CONTAINER_MOUNTS="/shared:/shared")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (srun,) = [r for r in rec["srun"] if r["argv"]]
    argv = srun["argv"]
    assert "--container-image=/shared/megatron-async.sqsh" in argv
    assert f"--container-mounts={REPO}:{REPO},/shared:/shared" in argv
    assert f"--container-workdir={REPO}" in argv
    assert len(rec["torchrun"]) == 2


def test_no_container_flags_without_an_image(tmp_path):
    proc, rec = run_batch(tmp_path, "pretrain.sbatch", HOSTS4[:1], CHECKPOINT_DIR=str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not any(a.startswith("--container") for a in rec["srun"][0]["argv"])


def test_srun_one_task_per_gpu_makes_every_task_a_rank(tmp_path):
    proc, rec = run_batch(tmp_path, "pretrain.sbatch", HOSTS4[:2], CHECKPOINT_DIR=str(tmp_path / "c"), LAUNCHER="srun")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--ntasks-per-node=8" in rec["srun"][0]["argv"] and "--nodes=2" in rec["srun"][0]["argv"]
    assert rec["torchrun"] == []
    tasks = rec["python"]
    assert sorted(int(t["env"]["SLURM_PROCID"]) for t in tasks) == list(range(16))
    for t in tasks:
        assert t["argv"][0] == str(REPO / "pretrain_gpt.py")
        assert flag(t["argv"], "--pipeline-model-parallel-size") == "8"
        assert int(flag(t["argv"], "--global-batch-size")) == 4 * 8 * 2  # MBS x m x DP (= nodes)
        assert t["env"]["MASTER_ADDR"] == "gpu07"


@pytest.mark.parametrize("overrides, message", [
    ({"LAUNCHER": "srun", "PP": "3", "DP": "1"}, "but the srun step has SLURM_NTASKS=32 tasks"),
    ({"MOCK_DATA": "0"}, "no DATA_PATH: a cluster job does not train on mock data unless MOCK_DATA=1"),
    ({"GPUS_PER_NODE": "16"}, "GPUS_PER_NODE=16 but the job has 8 GPUs per node (submit with sbatch --gpus-per-node=16)"),
])
def test_cluster_refusals_start_no_rank(tmp_path, overrides, message):
    proc, rec = run_batch(tmp_path, "pretrain.sbatch", HOSTS4, CHECKPOINT_DIR=str(tmp_path / "c"), **overrides)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert rec["torchrun"] == [] and rec["python"] == []


def test_sbatch_gpus_per_node_sets_the_ranks_per_node(tmp_path):
    """`sbatch --gpus-per-node=4` (SLURM_GPUS_ON_NODE=4) overrides the script's 8."""
    proc, rec = run_batch(tmp_path, "pretrain.sbatch", HOSTS4[:2], CHECKPOINT_DIR=str(tmp_path / "c"),
                          SLURM_GPUS_ON_NODE="4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {flag(r["argv"], "--nproc-per-node") for r in rec["torchrun"]} == {"4"}


# ------------------------------------------------------------------ the trainer's side of srun

def _fake_scontrol(tmp_path: Path, hosts: str) -> dict[str, str]:
    bin_dir = _fakes(tmp_path)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_HOSTS": hosts,
            "FAKE_LOG": str(tmp_path / "calls.jsonl")}


def test_slurm_task_variables_become_torchrun_variables(tmp_path, monkeypatch):
    for key, value in _fake_scontrol(tmp_path, "node17 node18").items():
        monkeypatch.setenv(key, value)
    env = {"SLURM_STEP_ID": "3", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8",
           "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "node[17-18]",
           "SLURM_JOB_ID": "123456"}
    assert adopt_slurm_task_environment(env)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("5", "1", "8", "4")
    assert env["MASTER_ADDR"] == "node17" and env["MASTER_PORT"] == str(20000 + 123456 % 20000)
    # torchrun's own variables win; a batch shell (no step) or a one-task step stays a launcher
    assert not adopt_slurm_task_environment({**env, "SLURM_PROCID": "2"})  # RANK is set now
    for not_a_rank in ({k: v for k, v in env.items() if k not in ("SLURM_STEP_ID", "RANK", "WORLD_SIZE")},
                       {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}):
        before = dict(not_a_rank)
        assert not adopt_slurm_task_environment(not_a_rank) and not_a_rank == before
    assert tasks_on_this_node({"SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2", "SLURM_NTASKS": "11"}) == "3"


def test_two_srun_tasks_train_as_two_ranks(tmp_path):
    """Real ranks, started as srun starts tasks (no RANK): each is a rank, none a launcher."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("SLURM_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                        "MASTER_PORT", "MEGATRON_ASYNC_LAUNCHED")}
    base.update(_fake_scontrol(tmp_path, "127.0.0.1"), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
                SLURM_STEP_ID="0", SLURM_NTASKS="2", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="1",
                MASTER_PORT=str(port))
    argv = [sys.executable, str(REPO / "pretrain_gpt.py"), "--pipeline-model-parallel-size", "2", "--num-layers", "2",
            "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16", "--vocab-size", "64",
            "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2", "--log-interval", "1",
            "--num-threads", "1", "--device", "cpu", "--pipeline-timeout-seconds", "60"]
    procs = [subprocess.Popen(argv, env=dict(base, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)), cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    assert "iteration        2/       2" in outs[0][0]
    assert not any("forwarding" in e or "megatron-rank" in e for _, e in outs)
    assert [r["argv"][:2] for r in records_of(tmp_path)["scontrol"]] == [["show", "hostnames"]] * 2


@pytest.mark.parametrize("restart_count,requeued", [("0", True), ("1", True), ("2", False)])
def test_a_failed_step_requeues_the_job_up_to_max_requeues(tmp_path, restart_count, requeued):
    """A rank killed (the step exits non-zero by itself): requeued while SLURM_RESTART_COUNT <
    MAX_REQUEUES, and the requeued job runs the same --load; torchrun gets MAX_RESTARTS."""
    ckpt = tmp_path / "ckpt"
    proc, rec = run_batch(tmp_path, "pretrain.sbatch", HOSTS4[:1], CHECKPOINT_DIR=str(ckpt), FAKE_TORCHRUN_EXIT="1",
                          MAX_REQUEUES="2", MAX_RESTARTS="3", SLURM_RESTART_COUNT=restart_count)
    requeues = [r["argv"] for r in rec["scontrol"] if r["argv"][:1] == ["requeue"]]
    assert requeues == ([["requeue", "4242"]] if requeued else []), proc.stderr[-3000:]
    assert proc.returncode == (0 if requeued else 1), proc.stderr[-3000:]
    if requeued:
        assert f"requeueing job 4242 (requeue {int(restart_count) + 1} of 2)" in proc.stderr
    (run,) = rec["torchrun"]
    assert flag(run["argv"], "--max-restarts") == "3"
    train = trainer_args(run["argv"])
    assert flag(train, "--load") == flag(train, "--save") == str(ckpt)


def test_a_failed_step_fails_the_job_by_default(tmp_path):
    proc, rec = run_batch(tmp_path, "pretrain.sbatch", HOSTS4[:1], FAKE_TORCHRUN_EXIT="1")
    assert proc.returncode == 1 and not [r for r in rec["scontrol"] if r["argv"][:1] == ["requeue"]]
    assert flag(rec["torchrun"][0]["argv"], "--max-restarts") == "0"
