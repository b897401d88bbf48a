"""`bash examples/pretrain_gpt_paci.sh` runs on a CPU-only machine with no arguments (shortened)."""
from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

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
