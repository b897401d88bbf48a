"""Train several configurations through the emulator (``--pipeline-executor emulator``) in one
process, so each costs its training and not a fresh interpreter with torch and megatron-core.

    python -m benchmarks.gpucheck.emulator_runs SPEC.json RESULT.json

SPEC: ``{"deadline": <time.time()>, "warmup": K, "runs": [{"name": ..., "argv": [...]}]}``, the
argv being ``pretrain_gpt.py``'s flags (the same run is ``python pretrain_gpt.py ARGV
--pipeline-executor emulator``). RESULT maps each name to its losses, median tokens/s after K
warm-up iterations, logged per-stage peaks, the CUDA allocator's peak over the whole run, any
printed line about a memory estimate, and the error of a run that failed (the next one runs).
A run not started before the deadline is recorded as skipped. RESULT is rewritten after every
run, so a run killed at the step's deadline leaves the finished ones behind.
"""
from __future__ import annotations

import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path


def summarise(records: list[dict], warmup: int) -> dict:
    train = [r for r in records if "loss" in r and "eval_split" not in r]
    steady = train[warmup:] or train
    out = {"losses": [r["loss"] for r in train],
           "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady) if steady else None,
           "peak_memory_mb": [max(col) for col in zip(*(r["peak_memory_mb"] for r in train))]}
    if train and "peak_activation_mb" in train[0]:
        out["peak_activation_mb"] = [max(col) for col in zip(*(r["peak_activation_mb"] for r in train))]
    return out


def run_one(argv: list[str], warmup: int, workdir: Path) -> dict:
    import torch

    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.loop.training import emulate
    from megatron.trainer.tasks.gpt import GPTTask

    log = workdir / "log.jsonl"
    log.unlink(missing_ok=True)
    task = GPTTask()
    parser = build_parser()
    task.add_arguments(parser)
    config = parse_run_plan([*argv, "--pipeline-executor", "emulator", "--log-json", str(log)], parser)
    cuda = config.launch.device == "cuda" or (config.launch.device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    printed = io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stdout(printed):
        emulate(task, config)
    out = summarise([json.loads(line) for line in log.read_text().splitlines()], warmup)
    out["wall_s"] = round(time.monotonic() - start, 2)
    if cuda:
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    out["estimate_lines"] = [line for line in printed.getvalue().splitlines() if "estimate" in line.lower()]
    return out


def main(spec_path: str, result_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for run in spec["runs"]:
            if time.time() > spec["deadline"]:
                results[run["name"]] = {"skipped": "step budget spent"}
            else:
                try:
                    results[run["name"]] = run_one(run["argv"], spec.get("warmup", 0), Path(tmp))
                except Exception as exc:  # noqa: BLE001 - record it, run the next configuration
                    results[run["name"]] = {"error": f"{type(exc).__name__}: {exc}",
                                            "traceback": traceback.format_exc()[-2000:]}
            Path(result_path).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
