"""examples/slurm/*.sbatch under fake `srun`, `scontrol` and `torchrun` executables.

The fakes record their argv and environment; the fake srun starts its command once per node
with SLURM_NODEID / SLURM_PROCID set, as Slurm does with one task per node. The batch
scripts run from a copy outside the repository (sbatch runs a spooled copy), so they must
find the repository through SLURM_SUBMIT_DIR.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SLURM = REPO / "examples" / "slurm"

FAKE_RECORDER = f"""#!{sys.executable}
import json, os, sys
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({{"prog": os.path.basename(sys.argv[0]), "argv": sys.argv[1:],
                         "env": {{k: v for k, v in os.environ.items()
                                 if k.startswith(("SLURM_", "NODE_RANK", "MASTER_", "NNODES", "GPUS_PER_NODE"))}}}}) + "\\n")
"""

FAKE_SCONTROL = FAKE_RECORDER + """
if sys.argv[1:3] == ["show", "hostnames"]:
    print("\\n".join(os.environ["FAKE_HOSTS"].split()))
else:
    sys.exit("fake scontrol: unexpected arguments %r" % sys.argv[1:])
"""

# One task per node: run the command once per node (sequentially) with Slurm's per-task variables.
FAKE_SRUN = FAKE_RECORDER + """
import subprocess
args = sys.argv[1:]
opts = {}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    opts[key] = value
assert opts.get("ntasks-per-node") == "1", opts
for node in range(int(opts["nodes"])):
    env = dict(os.environ, SLURM_PROCID=str(node), SLURM_LOCALID="0", SLURM_STEP_ID="0")
    if os.environ.get("FAKE_SRUN_NO_NODEID") == "1":
        env.pop("SLURM_NODEID", None)
    else:
        env["SLURM_NODEID"] = str(node)
    rc = subprocess.call(args, env=env)
    if rc:
        sys.exit(rc)
"""


def _fakes(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("torchrun", FAKE_RECORDER)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def run_batch(tmp_path: Path, script: str, hosts: list[str], **env_overrides: str):
    """Run a copy of examples/slurm/SCRIPT in a fake allocation; return (proc, records by prog)."""
    bin_dir = _fakes(tmp_path)
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(SLURM / script, spool / "slurm_script")
    log = tmp_path / "calls.jsonl"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in (
               "NODES", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "PP", "DP",
               "SCHEDULE", "MODEL", "EXAMPLE", "CHECKPOINT_DIR", "TRAIN_ITERS", "MICRO_BATCHES", "DATA_PATH",
               "FORCE_CPU", "EXECUTOR", "DRY_RUN", "EXTRA_ARGS", "REPO_DIR", "LOG_JSON")}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_LOG=str(log), FAKE_HOSTS=" ".join(hosts),
        SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=f"gpu[{hosts[0][3:]}-{hosts[-1][3:]}]",
        SLURM_JOB_NUM_NODES=str(len(hosts)), SLURM_NNODES=str(len(hosts)), SLURM_SUBMIT_DIR=str(REPO),
        SLURM_GPUS_ON_NODE="8", LOG_JSON=str(tmp_path / "log.jsonl"),
    )
    env.update(env_overrides)
    proc = subprocess.run(["bash", str(spool / "slurm_script")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    records: dict[str, list[dict]] = {"srun": [], "scontrol": [], "torchrun": []}
    if log.exists():
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            records[rec["prog"]].append(rec)
    return proc, records


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


SCHEDULES = ["1f1b", "interleaved-1f1b", "zb-2p", "async-1f1b", "pipedream-2bw", "pipemare", "amdp", "paci"]


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
