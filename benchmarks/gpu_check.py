"""One offline command that settles the CUDA path on one GPU (issue 29; docs/gpu.md, "Run the
GPU check").

    python benchmarks/gpu_check.py --wheels .whl --out runs/gpu_check            # on the GPU node
    python benchmarks/gpu_check.py --cpu-dry-run --out /tmp/gpu_check             # same steps, tiny, CPU

Installs the wheelhouse (``tools/make_wheelhouse.sh``) into a temporary target without network,
then runs six steps in order of value, each in child processes with its own share of the
budget: environment, the ``gpu``-marked tests, every schedule in the emulator, throughput and
MFU, peak memory per stage, a 2-rank run sharing the device. A step that fails is recorded and
the next one runs; the whole run ends within ``--budget-s`` (default 540 s: the device tool
allows 600 s per command, and start-up plus copying the results back need the rest).
Writes OUT/gpu_check.json and OUT/gpu_check.md; ``--only`` reruns chosen steps.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.gpucheck import report, steps, wheels  # noqa: E402
from benchmarks.gpucheck.proc import child_env  # noqa: E402
from benchmarks.gpucheck.sizes import CPU_DRY, GPU  # noqa: E402

# Shares of the budget, in the order the steps run; a step gets its share of what is left, so
# time one step does not use goes to the later ones.
SHARES = {"environment": 0.06, "gpu_tests": 0.27, "schedules": 0.2, "throughput": 0.25, "memory": 0.1,
          "distributed": 0.12}
INSTALL_SECONDS = 60.0
MIN_STEP_SECONDS = 10.0  # below this a step cannot even start its interpreter: skipped


@dataclass
class Step:
    name: str
    share: float
    floor: float = 45.0  # an interpreter with torch and megatron-core starts in ~10-30 s

    def budget(self, remaining: float, later_shares: float) -> float:
        return min(remaining, max(self.floor, remaining * self.share / (self.share + later_shares)))


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wheels", type=Path, default=None, help="wheelhouse to install (tools/make_wheelhouse.sh)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument("--cpu-dry-run", action="store_true", help="same steps, tiny sizes, on CPU")
    p.add_argument("--only", nargs="+", choices=list(SHARES), default=None, help="run only these steps")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak for MFU (default: by GPU name)")
    args = p.parse_args(argv)
    if args.budget_s < MIN_STEP_SECONDS:
        p.error(f"--budget-s {args.budget_s} is below {MIN_STEP_SECONDS} s")
    if args.wheels is not None and not args.wheels.is_dir():
        p.error(f"--wheels {args.wheels}: no such directory")
    if args.wheels is None and not args.cpu_dry_run:
        p.error("--wheels DIR is required on a GPU node (the node has no megatron-core); see docs/gpu.md")
    return args


def install(args: argparse.Namespace, target: Path, deadline: float) -> dict:
    if args.wheels is None:
        return {"status": "skipped", "figures": {"reason": "no --wheels (the dry run uses this interpreter's packages)"}}
    result, todo, kept = wheels.install(args.wheels, target, min(INSTALL_SECONDS, deadline - time.monotonic()))
    figures = {"installed": [w.name for w in todo], "kept_from_image": kept, "target": str(target)}
    if result is not None and result.returncode != 0:
        return {"status": "error", "figures": {**figures, "tail": result.tail()}}
    return {"status": "pass", "figures": figures}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    start = time.monotonic()
    deadline = start + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    me = shlex.join(["python", "benchmarks/gpu_check.py", *(["--cpu-dry-run"] if args.cpu_dry_run else []),
                     *(["--wheels", str(args.wheels)] if args.wheels else []), "--out", str(args.out)])
    header = {"mode": "cpu-dry-run" if args.cpu_dry_run else "gpu", "budget_s": args.budget_s, "command": me}
    entries: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_site_") as target:
        entries["install"] = {**install(args, Path(target), deadline), "reproduce": me + " --only environment"}
        ctx = steps.Context(CPU_DRY if args.cpu_dry_run else GPU, args.out, child_env([Path(target), REPO]),
                            peak_tflops=args.peak_tflops)
        chosen = [Step(n, s) for n, s in SHARES.items() if args.only is None or n in args.only]
        for i, step in enumerate(chosen):
            remaining = deadline - time.monotonic()
            budget = step.budget(remaining, sum(s.share for s in chosen[i + 1:]))
            began = time.monotonic()
            if budget < MIN_STEP_SECONDS:
                outcome = steps.Outcome("skipped", {"reason": f"{remaining:.0f} s of the budget left"}, [])
            else:
                try:
                    outcome = steps.STEPS[step.name](ctx, budget)
                except Exception as exc:  # noqa: BLE001 - a broken step is recorded; the next one runs
                    outcome = steps.Outcome("error", {"exception": f"{type(exc).__name__}: {exc}",
                                                      "traceback": traceback.format_exc()[-2000:]}, [])
            entries[step.name] = {"status": outcome.status, "figures": outcome.figures, "budget_s": round(budget, 1),
                                  "seconds": round(time.monotonic() - began, 1), "commands": outcome.commands,
                                  "reproduce": f"{me} --only {step.name}"}
            print(f"[gpu_check] {step.name}: {outcome.status} ({entries[step.name]['seconds']} s)", flush=True)
            header.update(device=ctx.device_name or None, seconds=round(time.monotonic() - start, 1))
            report.write(args.out, header, entries)  # after every step: a killed run leaves what it did
    print(f"[gpu_check] wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}", flush=True)
    return 0 if all(e["status"] in ("pass", "skipped", "unsupported") for e in entries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
