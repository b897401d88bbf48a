"""The emulator's own cost per op, in the working tree against a base revision, in one run.

Why: the op-dispatch path (executor -> op core -> worker, the hooks each op checks) runs for
every op of every stage; a refactor of the runtime must not make it slower (issue #40, item 5).
Stages are tiny -- one bias-free ``Linear(dim, dim)`` per stage on a ``[2, dim]`` activation,
plain SGD -- and runs have many ops, so what is timed is mostly dispatch and bookkeeping.

How: the base revision is checked out with ``git worktree add`` into a temporary directory
(removed at the end). Each side runs in a child process of its own that imports ``megatron``
from its tree, builds fresh workers per run and times only ``Emulator.run`` (main-thread CPU
time, ``time.thread_time``: a preempted child on the loaded 2-core host does not count the
wait), median over ``--runs`` runs after one warm-up run. The sides take turns in interleaved
pairs (the first of a pair alternates), so a pair is seconds apart and sees the same load; the
ratio new/base is formed per pair and summarised by its median and min-max.

    python benchmarks/investigations/emulator_overhead.py                 # base 49222bb, 5 pairs, ~1.5 min
    python benchmarks/investigations/emulator_overhead.py --base HEAD~1 --pairs 7 --json overhead.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_BASE = "49222bb"


# ------------------------------------------------------------------ one side, in its own process


def child(root: Path, stages: int, microbatches: int, iterations: int, runs: int, dim: int, schedule: str) -> dict:
    """CPU microseconds per op of ``runs`` emulator runs with ``root``'s ``megatron``.

    Only the API both revisions share is used: ``StageSetup``, ``StageWorker``, ``Emulator``,
    ``ReportCadence``, ``build_schedule``."""
    sys.path.insert(0, str(root))
    import torch

    import megatron.pipeline.runtime.worker as worker_module
    from megatron.pipeline.runtime.executors.common import ReportCadence
    from megatron.pipeline.runtime.executors.emulator import Emulator
    from megatron.pipeline.runtime.stage_optimizer import StageOptimizer
    from megatron.pipeline.runtime.worker import StageSetup, StageWorker
    from megatron.pipeline.schedules import ScheduleConfig, build_schedule

    torch.set_num_threads(1)

    class SGD(StageOptimizer):
        """``w <- w - lr * scale * g`` through ``p.data``: the least an optimizer step can be."""

        def __init__(self, params: list[torch.nn.Parameter]):
            self._params = params
            self.step_count = 0

        def parameters(self) -> list[torch.nn.Parameter]:
            return self._params

        def grad_sq_norm(self) -> torch.Tensor:
            return sum((p.grad.double().square().sum() for p in self._params if p.grad is not None),
                       torch.zeros((), dtype=torch.float64))

        def clip_coef(self, total_norm: float, max_norm: float) -> float:
            return min(1.0, max_norm / (total_norm + 1e-6))

        def step(self, lr: float, grad_scale: float = 1.0) -> None:
            self.step_count += 1
            for p in self._params:
                p.data.add_(p.grad, alpha=-lr * grad_scale)

        def rollback(self, lr: float, grad_scale: float = 1.0) -> None:
            raise NotImplementedError

        def zero_grad(self) -> None:
            for p in self._params:
                p.grad = None

    class Stage(torch.nn.Module):
        """One linear layer; the first stage reads the micro-batch's input."""

        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(dim, dim, bias=False)

        def forward(self, x: torch.Tensor | None, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.linear(batch["x"] if x is None else x)

    class ConstantLR:
        def lr(self, step: int) -> float:
            return 1e-3

    class NoReports:
        def submit(self, report: object, replica: int) -> None:
            pass

    data = {"x": torch.randn(2, dim), "y": torch.randn(2, dim)}
    config = ScheduleConfig(stages, microbatches, iterations)
    ops = sum(len(list(stream)) for stream in build_schedule(schedule, config).streams())

    def workers() -> list[StageWorker]:
        torch.manual_seed(0)
        out = []
        for s in range(stages):
            module = Stage()
            setup = StageSetup(
                stage=s, layout=config.layout, chunks=[module], optimizer=SGD(list(module.parameters())),
                lr_schedule=ConstantLR(), microbatches_per_update=microbatches, batch_fn=lambda mb: data,
                loss_fn=lambda out, b: ((out - b["y"]).square().mean(), 2), activation_shape=(2, dim),
                activation_dtype=torch.float32, device=torch.device("cpu"))
            out.append(StageWorker(setup, isolate_rng=True))
        return out

    def timed_run() -> float:
        ws = workers()
        emulator = Emulator(ws, config.layout, ReportCadence(10**9), NoReports())
        streams = build_schedule(schedule, config).streams()
        start = time.thread_time()
        emulator.run(streams)
        return time.thread_time() - start

    timed_run()  # warm-up: lazy imports, first-touch allocations
    seconds = [timed_run() for _ in range(runs)]
    return {"us_per_op": 1e6 * statistics.median(seconds) / ops, "ops": ops, "worker": worker_module.__file__}


# ------------------------------------------------------------------ both sides, interleaved


def run_side(root: Path, a: argparse.Namespace) -> dict:
    """One child on ``root``'s tree (``PYTHONPATH`` set to it only, so neither an editable install
    nor the caller's path decides which ``megatron`` is timed)."""
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(root), "--stages", str(a.stages),
           "--microbatches", str(a.microbatches), "--iterations", str(a.iterations), "--runs", str(a.runs),
           "--dim", str(a.dim), "--schedule", a.schedule]
    out = subprocess.run(cmd, env=env, cwd=root, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if not Path(result["worker"]).resolve().is_relative_to(root.resolve()):
        raise RuntimeError(f"the child for {root} imported {result['worker']}")
    return result


def base_checkout(rev: str, directory: Path) -> Path:
    """``rev`` checked out (detached) under ``directory`` with ``git worktree add``."""
    path = directory / "base"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(path), rev], check=True)
    return path


def compare(a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="emulator-overhead-") as tmp:
        base = base_checkout(a.base, Path(tmp))
        try:
            sides = {"base": base, "new": REPO}
            rows = []
            for pair in range(a.pairs):
                order = ["base", "new"] if pair % 2 == 0 else ["new", "base"]
                got = {side: run_side(sides[side], a)["us_per_op"] for side in order}
                rows.append({"base": got["base"], "new": got["new"], "ratio": got["new"] / got["base"]})
                print(f"pair {pair + 1}: base {got['base']:.2f} us/op, new {got['new']:.2f} us/op, "
                      f"new/base {rows[-1]['ratio']:.3f}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=True)
    ratios = [r["ratio"] for r in rows]
    return {"base": a.base, "workload": {k: getattr(a, k) for k in ("schedule", "stages", "microbatches", "iterations", "dim", "runs")},
            "pairs": rows, "base_us_per_op": statistics.median(r["base"] for r in rows),
            "new_us_per_op": statistics.median(r["new"] for r in rows),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--base", default=DEFAULT_BASE, help=f"the revision to compare with (default {DEFAULT_BASE})")
    p.add_argument("--pairs", type=int, default=5, help="interleaved (base, new) pairs")
    p.add_argument("--runs", type=int, default=15, help="timed emulator runs per child (median)")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--dim", type=int, default=8, help="the stages' linear layer width")
    p.add_argument("--json", default=None, help="also write the result here")
    a = p.parse_args(argv)
    if a.child is not None:
        print(json.dumps(child(a.child, a.stages, a.microbatches, a.iterations, a.runs, a.dim, a.schedule)))
        return 0
    print(f"# emulator overhead: {a.schedule}, {a.stages} stages, {a.microbatches} micro-batches x "
          f"{a.iterations} iterations, Linear({a.dim}, {a.dim}) stages; CPU us per op, median of {a.runs} "
          f"runs per child; base {a.base} vs the working tree, {a.pairs} interleaved pairs", flush=True)
    result = compare(a)
    print(f"base {a.base}: {result['base_us_per_op']:.2f} us/op; working tree: {result['new_us_per_op']:.2f} us/op "
          f"(medians over pairs)")
    print(f"new/base: median {result['ratio_median']:.3f} (min {result['ratio_min']:.3f}, "
          f"max {result['ratio_max']:.3f}) over {a.pairs} pairs")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
