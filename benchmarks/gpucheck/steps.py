"""The six steps of the GPU check, one function each: ``step(ctx, budget_s) -> Outcome``.

A step runs its work in child processes (``proc.run``) killed at its budget, judges what came
back against an independent reference (a CPU run, the emulator, a formula) and returns a status
with the figures behind it. It never raises for a failure of the thing checked; the driver
records anything it does raise as an ``error``.
"""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.gpucheck.flops import mfu, peak_tflops
from benchmarks.gpucheck.proc import REPO, Result, python, run, shell
from benchmarks.gpucheck.sizes import COMPARED, Sizes
from megatron.pipeline.schedules import SCHEDULES

# Step 3's bound on |loss_device - loss_cpu| / loss_cpu, fp32, same seed (the issue's 1e-4).
# Why it is enough: iteration 1 differs only by summation order, ~sqrt(K) * 2**-24 relative
# per dot product of length K <= 1024, a few 1e-6 through 17 GEMMs; the lr of 1e-3 for 10 Adam
# steps moves each weight by <= 1e-2, and a rounding-level gradient difference changes Adam's
# normalised step only where the gradient is near zero, where it moves the loss least. The CPU
# dry run, where both sides run the same kernels, must give exactly 0.
FP32_DEVICE_VS_CPU = 1e-4
# Step 6: two ranks on one device against the emulator on that device, fp32: the same kernels
# on the same inputs; on CPU (one thread) bitwise (README, "Emulator"), on CUDA within 1e-5
# relative (docs/gpu.md section 7: cuBLAS may pick other algorithms per process).
RANKS_VS_EMULATOR = {"cpu": 0.0, "cuda": 1e-5}
PASSING_TESTS = ("PASSED", "SKIPPED", "XFAIL")


@dataclass
class Context:
    sizes: Sizes
    out: Path
    env: dict[str, str]
    peak_tflops: float | None = None
    device_name: str = ""
    shared: dict = field(default_factory=dict)  # figures later steps read (step 4's runs for step 5)

    def log(self, name: str) -> Path:
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        return self.out / "logs" / f"{name}.log"


@dataclass
class Outcome:
    status: str  # pass | fail | error | timeout | skipped | unsupported
    figures: dict
    commands: list[str]


def _last_json(result: Result) -> dict:
    lines = [line for line in result.output.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def _failed(result: Result, commands: list[str], **figures) -> Outcome | None:
    """The outcome of a child that timed out or exited non-zero, else None."""
    if result.timed_out:
        return Outcome("timeout", {**figures, "seconds": round(result.seconds, 1), "tail": result.tail()}, commands)
    if result.returncode != 0:
        return Outcome("error", {**figures, "exit": result.returncode, "tail": result.tail()}, commands)
    return None


def _emulate(ctx: Context, name: str, runs: dict[str, list[str]], budget: float, warmup: int = 0) -> tuple[dict, Outcome | None, list[str]]:
    """Run ``runs`` (name -> pretrain_gpt.py flags) through ``emulator_runs``; the per-run
    results, the outcome if the child itself failed, and each run's equivalent command."""
    spec, result_path = ctx.out / "logs" / f"{name}.spec.json", ctx.out / "logs" / f"{name}.result.json"
    ctx.log(name)
    spec.write_text(json.dumps({"deadline": time.time() + budget - 15, "warmup": warmup,
                                "runs": [{"name": k, "argv": v} for k, v in runs.items()]}))
    result_path.unlink(missing_ok=True)
    cmd = python("-m", "benchmarks.gpucheck.emulator_runs", str(spec), str(result_path))
    result = run(cmd, budget, ctx.env, ctx.log(name))
    commands = [shell(python(str(REPO / "pretrain_gpt.py"), *v, "--pipeline-executor", "emulator")) for v in runs.values()]
    results = json.loads(result_path.read_text()) if result_path.exists() else {}
    return results, _failed(result, commands, finished=sorted(results)), commands


def environment(ctx: Context, budget: float) -> Outcome:
    cmd = python("-m", "benchmarks.gpucheck.probe", "env")
    result = run(cmd, budget, ctx.env, ctx.log("environment"))
    failed = _failed(result, [shell(cmd)])
    if failed:
        return failed
    info = _last_json(result)
    ctx.device_name = info.get("gpu", "cpu")
    ok = info["megatron_core"].startswith("ok") and (ctx.sizes.device == "cpu" or (info["cuda_available"] and info.get("bf16")))
    return Outcome("pass" if ok else "fail", info, [shell(cmd)])


def gpu_test_files() -> list[str]:
    """The test files with ``gpu``-marked tests."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                  if "mark.gpu" in p.read_text())


def gpu_tests(ctx: Context, budget: float) -> Outcome:
    # test_gpt2_medium_throughput is step 4(b) with its figures judged; not run twice.
    cmd = python("-m", "pytest", "-m", "gpu", "-v", "-rA", "-p", "no:cacheprovider", "-n", "0",
                 "--deselect", "tests/test_gpu.py::test_gpt2_medium_throughput", *gpu_test_files())
    result = run(cmd, budget, ctx.env, ctx.log("gpu_tests"))
    tests = dict(re.findall(r"^(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|XFAIL|XPASS|ERROR)", result.output, re.M))
    counts = {s: sum(v == s for v in tests.values()) for s in sorted(set(tests.values()))}
    figures = {"counts": counts, "tests": tests}
    if result.timed_out:
        return Outcome("timeout", figures, [shell(cmd)])
    bad = result.returncode not in (0, 5) or any(v not in PASSING_TESTS for v in tests.values())
    return Outcome("fail" if bad or not tests else "pass", figures, [shell(cmd)])


def _falling(losses: list[float]) -> bool:
    """Finite, and the mean of the last third below the mean of the first third (one update's
    loss is noisy; a third of the run averages it out)."""
    third = len(losses) // 3
    return third > 0 and all(map(math.isfinite, losses)) and \
        sum(losses[-third:]) / third < sum(losses[:third]) / third


def _rel_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        return math.inf
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def schedules(ctx: Context, budget: float) -> Outcome:
    s = ctx.sizes
    runs = {f"{n} bf16": s.small_flags(n, "--bf16", "--device", s.device) for n in SCHEDULES}
    for n in COMPARED:
        runs[f"{n} fp32 {s.device}"] = s.small_flags(n, "--device", s.device)
        runs[f"{n} fp32 cpu-ref"] = s.small_flags(n, "--device", "cpu")
    results, failed, commands = _emulate(ctx, "schedules", runs, budget)
    per_run = {k: ("falling" if _falling(r.get("losses", [])) else r.get("error") or r.get("skipped") or f"losses {r.get('losses')}")
               for k, r in results.items() if k.endswith("bf16")}
    diffs = {n: _rel_diff(results.get(f"{n} fp32 {s.device}", {}).get("losses", []),
                          results.get(f"{n} fp32 cpu-ref", {}).get("losses", [])) for n in COMPARED}
    figures = {"bf16": per_run, "fp32_device_vs_cpu_max_rel_loss_diff": diffs, "bound": FP32_DEVICE_VS_CPU}
    if failed:
        failed.figures.update(figures)
        return failed
    ok = len(per_run) == len(SCHEDULES) and all(v == "falling" for v in per_run.values()) \
        and all(d <= FP32_DEVICE_VS_CPU for d in diffs.values())
    return Outcome("pass" if ok else "fail", figures, commands)


def _rate(tokens_per_s: float | None, ctx: Context) -> dict:
    value = mfu(tokens_per_s or 0.0, ctx.sizes.bench, peak_tflops(ctx.device_name, ctx.peak_tflops))
    return {"tokens_per_s": round(tokens_per_s or 0.0, 1), "mfu": None if value is None else round(value, 4)}


def throughput(ctx: Context, budget: float) -> Outcome:
    """(a) plain loop, (b) pretrain_gpt.py with one stage, (c) the emulator with 4 stages; the
    ratios (b)/(a), (c)/(a) are the runtime's overhead (goal >= 0.97; (a) >= 45 % MFU on H100)."""
    s, deadline = ctx.sizes, time.monotonic() + budget
    plain = python("-m", "benchmarks.gpucheck.plain_loop", str(s.bench_warmup), "--", *s.bench_flags(1))
    a = run(plain, budget / 4, ctx.env, ctx.log("throughput_a"))
    log = ctx.out / "logs" / "throughput_b.jsonl"
    log.unlink(missing_ok=True)
    pretrain = python(str(REPO / "pretrain_gpt.py"), *s.bench_flags(1), "--log-json", str(log))
    b = run(pretrain, budget / 4, ctx.env, ctx.log("throughput_b"))
    runs = {n: s.bench_flags(s.stages, n) for n in COMPARED}
    c, c_failed, c_commands = _emulate(ctx, "throughput_c", runs, max(deadline - time.monotonic(), 1), s.bench_warmup)
    ctx.shared["throughput_c"] = c
    commands = [shell(plain), shell(pretrain), *c_commands]
    figures: dict = {"model": vars(s.bench), "micro_batch": s.bench_micro, "microbatches": s.microbatches,
                     "peak_tflops": peak_tflops(ctx.device_name, ctx.peak_tflops)}
    for label, res in (("a", a), ("b", b)):
        bad = _failed(res, [])
        figures[label] = bad.figures if bad else None
    if figures["a"] is None:
        figures["a"] = _rate(_last_json(a).get("tokens_per_s"), ctx)
    if figures["b"] is None:
        from benchmarks.gpucheck.emulator_runs import summarise

        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        figures["b"] = _rate(summarise(records, s.bench_warmup)["tokens_per_s"] if records else None, ctx)
    for name, r in c.items():
        figures[f"c {name}"] = _rate(r.get("tokens_per_s"), ctx) if "tokens_per_s" in r else r
    base = figures["a"].get("tokens_per_s") if isinstance(figures["a"], dict) else None
    ratios = {k: round(v["tokens_per_s"] / base, 3) for k, v in figures.items()
              if base and k != "a" and isinstance(v, dict) and v.get("tokens_per_s")}
    figures["ratio_to_a"] = ratios
    ran = len(ratios) == 1 + len(COMPARED) and not c_failed
    if not ran:
        return Outcome("timeout" if c_failed and c_failed.status == "timeout" else "error", figures, commands)
    # Goals are reported, not failed on: a benchmark target (docs/gpu.md section 8).
    figures["goals_met"] = {"a_mfu>=0.45": (figures["a"]["mfu"] or 0) >= 0.45,
                            "ratios>=0.97": all(v >= 0.97 for v in ratios.values())}
    return Outcome("pass", figures, commands)


def memory(ctx: Context, budget: float) -> Outcome:
    """Peak memory per stage of step 4(c)'s configurations, with the saved-activation meter on
    (a short run of its own: the meter's hooks would slow the timed runs)."""
    s = ctx.sizes
    runs = {n: [*s.bench_flags(s.stages, n), "--train-iters", "3", "--log-activation-memory"] for n in COMPARED}
    results, failed, commands = _emulate(ctx, "memory", runs, budget)
    figures = {n: {k: r.get(k) for k in ("cuda_peak_mb", "peak_memory_mb", "peak_activation_mb", "error", "skipped")
                   if r.get(k) is not None} for n, r in results.items()}
    estimates = {n: r.get("estimate_lines") for n, r in results.items() if r.get("estimate_lines")}
    figures["estimate"] = estimates or "no estimate available (the trainer prints none yet)"
    if failed:
        failed.figures.update(figures)
        return failed
    ok = len(results) == len(COMPARED) and all("error" not in r and "skipped" not in r for r in results.values())
    return Outcome("pass" if ok else "fail", figures, commands)


def distributed(ctx: Context, budget: float) -> Outcome:
    """Two ranks sharing the one device over gloo (NCCL refuses two ranks on one GPU) against
    the emulator, if gloo carries this device's tensors; otherwise why not."""
    s, deadline = ctx.sizes, time.monotonic() + budget
    probe = python("-m", "benchmarks.gpucheck.probe", "p2p", s.device)
    p = run(probe, min(60.0, budget / 3), ctx.env, ctx.log("distributed_probe"))
    commands = [shell(probe)]
    if p.timed_out or p.returncode != 0:
        return Outcome("unsupported", {"reason": f"gloo send/recv of {s.device} tensors between two processes failed",
                                       "probe_exit": p.returncode, "tail": p.tail()}, commands)
    flags = [*s.small_flags("1f1b", "--device", s.device, "--distributed-backend", "gloo"),
             "--pipeline-model-parallel-size", "2", "--train-iters", "4"]
    log = ctx.out / "logs" / "distributed_ranks.jsonl"
    log.unlink(missing_ok=True)
    ranks = python(str(REPO / "pretrain_gpt.py"), *flags, "--log-json", str(log))
    r = run(ranks, (deadline - time.monotonic()) / 2, ctx.env, ctx.log("distributed_ranks"))
    commands.append(shell(ranks))
    failed = _failed(r, commands)
    if failed:
        return failed
    reference = [f for f in flags if f not in ("--distributed-backend", "gloo")]
    emu, emu_failed, emu_commands = _emulate(ctx, "distributed_emulator", {"emulator": reference},
                                             max(deadline - time.monotonic(), 1))
    commands += emu_commands
    if emu_failed:
        return emu_failed
    records = [json.loads(line) for line in log.read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r and "eval_split" not in r]
    diff = _rel_diff(losses, emu["emulator"].get("losses", []))
    bound = RANKS_VS_EMULATOR[s.device]
    figures = {"ranks_losses": losses, "emulator_losses": emu["emulator"].get("losses"),
               "max_rel_loss_diff": diff, "bound": bound}
    return Outcome("pass" if diff <= bound else "fail", figures, commands)


STEPS = {"environment": environment, "gpu_tests": gpu_tests, "schedules": schedules,
         "throughput": throughput, "memory": memory, "distributed": distributed}
