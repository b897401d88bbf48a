"""Calibrate the simulator's runtime terms at pipeline depth N from a short traced run.

Why a separate run: a prediction must not be fitted to the runs it is compared with. This runs
1F1B with a few micro-batches (``--calibration-microbatches``, default 2) through the real
distributed runtime at depth N on synthetic-cost stages (``benchmarks/harness/synthetic_stage_run.py``,
the same runner as the benchmarks), with ``--trace-dir``, and reads the terms off the trace
(:mod:`megatron.pipeline.costs.calibration`): ``t_send`` (the ``isend`` call on the sender's
timeline), ``t_comm`` (the message's trip and the receiver's wake-up) and ``t_sync`` (the
synchronous step at depth N: norm all-gather over the N ranks, stage 0 collecting statistics,
all N ranks waking on the host's cores at once). The per-op cost ``per_op`` stays the N = 1
baseline's; the trace's ``per_op_at_depth`` is printed beside it as a check of CPU
oversubscription.

    python benchmarks/calibrate_runtime.py --stages 4 8 --forward-ms 20 --backward-ms 20 --wgrad-ms 20 --repeats 3

``benchmarks/zero_bubble_synthetic.py`` runs the same calibration interleaved with its cases.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from megatron.pipeline.costs.calibration import Calibration, calibrate, median_calibration  # noqa: E402
from megatron.pipeline.costs.op_costs import OpCosts  # noqa: E402
from megatron.pipeline.trace_analysis import layout_of, load_traces, replica, skip_iterations  # noqa: E402
from schedule_efficiency import Case, Result, build_parser, run_case  # noqa: E402

CALIBRATION_NOTE = "calibration"
CALIBRATION_WARMUP_ITERATIONS = 2  # start-up, the first backward's one-time imports


def add_calibration_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("calibration run (traced 1F1B at each depth N)")
    g.add_argument("--calibration-microbatches", type=int, default=2, help="m of the calibration run")
    g.add_argument("--calibration-iterations", type=int, default=8,
                   help=f"iterations of the calibration run; the first {CALIBRATION_WARMUP_ITERATIONS} are skipped")


def calibration_case(n: int, args: argparse.Namespace, trace_dir: Path) -> Case:
    """The traced calibration run at depth ``n`` (log interval as the benchmark's: the
    statistics collected at logging steps are part of ``t_sync``)."""
    return Case("1f1b", n, args.calibration_microbatches, args.calibration_iterations, args.log_interval,
                note=CALIBRATION_NOTE, extra_args=("--trace-dir", str(trace_dir)))


def run_calibration(n: int, sleeps: OpCosts, args: argparse.Namespace, workdir: Path) -> tuple[Result, Calibration | None]:
    """Run the calibration at depth ``n`` (``args.forward_ms`` etc. set to ``sleeps``) and
    measure its terms; the Calibration is None when the run failed."""
    trace_dir = workdir / f"calibration-N{n}"
    for f in trace_dir.glob("*.json"):
        f.unlink()
    case = calibration_case(n, args, trace_dir)
    result = run_case(case, args, workdir)
    if result.error:
        return result, None
    traces = replica(load_traces(trace_dir))
    spans = [skip_iterations(t.spans, CALIBRATION_WARMUP_ITERATIONS, case.microbatches) for t in traces]
    return result, calibrate(spans, layout_of(traces), sleeps, args.log_interval)


def describe(cal: Calibration) -> str:
    return (f"t_send {cal.t_send:.3f} ms, t_comm {cal.t_comm:.3f} ms (trip {cal.latency:.3f} - gap {cal.gap:.3f}), "
            f"t_sync {cal.t_sync:.2f} ms, per-op cost at depth {cal.per_op_at_depth:.2f} ms")


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    p.description = __doc__.split("\n\n")[0]
    p.set_defaults(repeats=3, nice=-10, baseline=False)
    add_calibration_args(p)
    args = p.parse_args(argv)
    sleeps = OpCosts(args.forward_ms, args.backward_ms, args.wgrad_ms)
    with tempfile.TemporaryDirectory(prefix="calibrate-runtime-") as tmp:
        found: dict[int, list[Calibration]] = {n: [] for n in args.stages}
        for rep in range(args.repeats):
            for n in args.stages:
                result, cal = run_calibration(n, sleeps, args, Path(tmp))
                print(f"#   [{rep + 1}/{args.repeats}] N={n}: {result.error or describe(cal)}  "  # type: ignore[arg-type]
                      f"[load {result.load_after:.1f}]", file=sys.stderr, flush=True)
                if cal is not None:
                    found[n].append(cal)
    print(f"# runtime terms, median of {args.repeats} calibration run(s) (1f1b, m={args.calibration_microbatches}, "
          f"{args.calibration_iterations} iterations, sleeps {args.forward_ms:g}/{args.backward_ms:g}/{args.wgrad_ms:g} ms); "
          f"{os.cpu_count()} CPU cores")
    for n, cals in found.items():
        print(f"N={n}: {describe(median_calibration(cals)) if cals else 'no successful run'}")
    return 0 if all(found.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
