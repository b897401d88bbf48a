"""``tools/plan_pipeline.py --profile``: the planner's unit costs measured on this machine.

Why through the trainer: the runtime's own profiling path (``--zb-profile-iters``, the
executors' :mod:`~megatron.pipeline.runtime.profiling`) times F, B and W of every op and the P2P
link exactly as a real run sees them; a separate micro-benchmark would time different code. One
process: the emulator runs both stages of a 2-stage zb-1p, evenly split, for ``PROFILE_ITERS``
profiled iterations (ZB-H1) plus one, on mock data, and the logged per-stage costs are turned into
per-layer and head costs (:func:`~megatron.pipeline.planner.unit_costs.from_two_stage_profile`).
The optimizer step and the data-parallel reduction are not profiled (0).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from megatron.pipeline.planner.unit_costs import UnitCosts, from_two_stage_profile
from megatron.pipeline.schedules.zb_1p import ZB1P

PROFILE_ITERS = 2
MARKER = "zero-bubble-schedule "
#: the model, batch and precision flags forwarded to the profiling run (dest -> flag)
MODEL_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "seq_length", "max_position_embeddings", "vocab_size", "normalization", "position_embedding_type",
               "micro_batch_size")


def profile_command(args: argparse.Namespace) -> list[str]:
    """The one-process emulator run that profiles ``args``' model (module docstring)."""
    script = Path(__file__).resolve().parents[3] / "pretrain_gpt.py"
    cmd = [sys.executable, str(script)]
    flags = vars(args)  # the flags by dest
    for dest in MODEL_FLAGS:
        value = flags.get(dest)
        if value is not None:
            cmd += ["--" + dest.replace("_", "-"), str(value)]
    for flag in ("bf16", "fp16", "swiglu"):
        if flags.get(flag):
            cmd.append("--" + flag)
    m = max(2, args.global_batch_size // (args.micro_batch_size * args.data_parallel_size))
    return cmd + ["--global-batch-size", str(m * args.micro_batch_size), "--data-parallel-size", "1",
                  "--pipeline-model-parallel-size", "2", "--pipeline-schedule", ZB1P.name,
                  "--zb-profile-iters", str(PROFILE_ITERS), "--pipeline-executor", "emulator",
                  "--train-iters", str(PROFILE_ITERS + 1), "--mock-data", "--pipeline-partition", "even",
                  "--log-interval", "1"]


def profile_unit_costs(args: argparse.Namespace) -> UnitCosts:
    """Run the profile and read its costs; ValueError (one line) when the run gives none."""
    if args.num_layers % 2:
        raise ValueError(f"--profile splits the model over 2 stages evenly; --num-layers {args.num_layers} is odd")
    run = subprocess.run(profile_command(args), capture_output=True, text=True)
    for line in run.stdout.splitlines():
        if MARKER in line:
            costs = json.loads(line.split(MARKER, 1)[1])["costs"]
            half = args.num_layers // 2
            return from_two_stage_profile(costs, (half, half), args.micro_batch_size, source="profiled:this host")
    tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
    raise ValueError(f"the profiling run logged no costs (exit {run.returncode}): {tail[0]}")
