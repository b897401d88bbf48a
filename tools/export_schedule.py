"""Write a schedule's per-rank compute order as torch.distributed.pipelining's compute-only CSV.

    python tools/export_schedule.py --schedule zb-v --pipeline-model-parallel-size 4 --microbatches 8 \\
        --format torch-csv --output zbv_4x8.csv
    python tools/export_schedule.py --schedule zb-2p --pipeline-model-parallel-size 4 --microbatches 8 \\
        --zb-costs 18.522,18.086,9.337,0.601 --format torch-csv --output zb2p.csv
    python tools/export_schedule.py --compare-torch --pipeline-model-parallel-size 4 --microbatches 8 16

The CSV runs in torch's ``_PipelineScheduleRuntime._load_csv`` (torchtitan:
``pipeline_parallel_schedule_csv``; the tool prints the matching settings). Our split backward
maps to ``I`` (input) and ``W`` (weight), a fused backward to ``B``; stage indices are torch's
(loop: rank r holds r, r + N, ...; V: r and 2N - 1 - r). Every synchronous schedule exports;
asynchronous ones are refused with the reason. zb-1p / zb-2p / zb-v are ordered from
``--zb-costs`` (default: T_F = T_B = T_W = 1), never profiled: a CSV is one fixed order.
``--num-model-chunks`` (default 2) is for interleaved-1f1b.

``--compare-torch`` prints the table of docs/schedules.md: for each of torch's seven schedule
classes (their orders dumped from torch, needs torch) and each of our synchronous schedules, the
simulated bubble rate and peak activations (whole-stage ``M_B``, ``M_W = M_B / 2``) at
``T_F = T_B = T_W`` and at the Zero Bubble paper's Table 6 costs (1.5B: 18.522, 18.086, 9.337,
T_comm 0.601 ms per stage; a chunk of a stage that holds v runs 1/v of them).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron.pipeline.replay import ScheduleError  # noqa: E402
from megatron.pipeline.schedules import SCHEDULES, ScheduleConfig, ScheduleConfigError, schedule_class  # noqa: E402
from megatron.pipeline.torch_actions import TorchOrderError, check_order, write_csv  # noqa: E402
from megatron.pipeline.torch_export import export_order, torchtitan_settings  # noqa: E402

#: (T_F, T_B, T_W, T_comm) per whole stage: equal costs, and the Zero Bubble paper's Table 6 (1.5B)
COMPARE_COSTS = {"equal": (1.0, 1.0, 1.0, 0.0), "table6": (18.522, 18.086, 9.337, 0.601)}
#: M_W / M_B of the comparison (the simulator's reference units), also what cost-driven orders plan with
COMPARE_M_W = 0.5


def synchronous_schedules() -> list[str]:
    return [name for name, cls in SCHEDULES.items() if not cls.traits.asynchronous]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", choices=sorted(SCHEDULES))
    ap.add_argument("--pipeline-model-parallel-size", type=int, required=True, metavar="N")
    ap.add_argument("--microbatches", type=int, nargs="+", required=True, metavar="m")
    ap.add_argument("--num-model-chunks", type=int, default=None, metavar="V",
                    help="chunks per stage of a schedule that takes them (interleaved-1f1b; default 2)")
    ap.add_argument("--zb-costs", default=None, metavar="T_F,T_B,T_W,T_COMM[,M_W/M_B] | PROFILE.json",
                    help="costs a cost-driven order (zb-1p, zb-2p, zb-v) is searched with")
    ap.add_argument("--zb-memory-limit", type=float, default=None, metavar="X")
    ap.add_argument("--format", choices=["torch-csv"], default="torch-csv")
    ap.add_argument("--output", default=None, metavar="FILE", help="the CSV (default: stdout)")
    ap.add_argument("--compare-torch", action="store_true", help="print docs/schedules.md's comparison table")
    args = ap.parse_args(argv)
    if not args.compare_torch:
        if args.schedule is None:
            ap.error("--schedule is required (or --compare-torch)")
        if len(args.microbatches) != 1:
            ap.error("--microbatches takes one value when exporting")
    return args


def export(args: argparse.Namespace) -> int:
    flags = {k: v for k, v in (("zb_costs", args.zb_costs), ("zb_memory_limit", args.zb_memory_limit)) if v is not None}
    taken = {flag.dest for group in schedule_class(args.schedule).traits.flag_groups for flag in group.flags}
    extra = sorted(set(flags) - taken)
    if extra:
        print(f"error: --{extra[0].replace('_', '-')} is not a flag of {args.schedule}", file=sys.stderr)
        return 2
    try:
        order = export_order(args.schedule, args.pipeline_model_parallel_size, args.microbatches[0],
                             args.num_model_chunks, flags)
        check_order(order, source=args.schedule)
    except (ScheduleConfigError, ScheduleError, TorchOrderError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.output is None:
        sys.stdout.write(order.to_csv())
        return 0
    write_csv(order, args.output)
    print(f"{args.schedule}: {order.num_ranks} ranks x {order.stages_per_rank} stage(s), "
          f"{order.num_microbatches} micro-batches, {order.placement} placement -> {args.output}")
    print(f"torchtitan: {torchtitan_settings(order, args.output)}")
    return 0


def compare_rows(num_stages: int, microbatches: list[int]) -> list[str]:
    """docs/schedules.md's table (module docstring), one markdown row per schedule."""
    from megatron.interop.torch_pipelining import TORCH_SCHEDULES, torch_order_csv
    from megatron.pipeline.costs.op_costs import OpCosts
    from megatron.pipeline.simulator import simulate_streams
    from megatron.pipeline.torch_actions import parse_csv

    def cell(order, costs: tuple[float, float, float, float]) -> str:
        v = order.stages_per_rank
        t_f, t_b, t_w, t_comm = costs
        per_chunk = OpCosts(t_f / v, t_b / v, t_w / v, t_comm=t_comm, m_w=COMPARE_M_W)
        try:
            check_order(order)
            result = simulate_streams(order.streams(), order.layout, per_chunk)
        except (TorchOrderError, ScheduleError) as exc:
            return f"refused: {str(exc)[:60]}"
        return f"{result.bubble_rate:.3f} / {max(result.peak_memory) / v:.2f}"

    rows = []
    for name in TORCH_SCHEDULES:
        cells = []
        for m in microbatches:
            try:
                order = parse_csv(torch_order_csv(name, num_stages, m), source=name)
            except (TorchOrderError, ValueError) as exc:  # torch refuses some (N, m)
                cells += [f"n/a ({str(exc)[:50]})"] * len(COMPARE_COSTS)
                continue
            cells += [cell(order, costs) for costs in COMPARE_COSTS.values()]
        rows.append(f"| torch `{name}` | {' | '.join(cells)} |")
    for name in synchronous_schedules():
        cells = []
        for m in microbatches:
            for costs in COMPARE_COSTS.values():
                cls = schedule_class(name)
                v = cls.traits.layout_of(ScheduleConfig(num_stages, m, num_chunks=2 if cls.traits.takes_model_chunks else 1)).num_chunks
                per_chunk = (costs[0] / v, costs[1] / v, costs[2] / v, costs[3], COMPARE_M_W)  # zb-v plans per chunk
                zb = ",".join(f"{c:g}" for c in per_chunk)
                taken = {f.dest for g in cls.traits.flag_groups for f in g.flags}
                try:
                    order = export_order(name, num_stages, m, None, {"zb_costs": zb} if "zb_costs" in taken else None)
                except (ScheduleConfigError, TorchOrderError) as exc:
                    cells.append(f"n/a ({str(exc)[:50]})")
                    continue
                cells.append(cell(order, costs))
        rows.append(f"| ours `{name}` | {' | '.join(cells)} |")
    return rows


def compare(args: argparse.Namespace) -> int:
    n, ms = args.pipeline_model_parallel_size, args.microbatches
    heads = [f"m={m} {label}" for m in ms for label in ("T_F=T_B=T_W", "Table 6")]
    print(f"N = {n}; each cell: bubble rate / peak activations (whole-stage M_B)\n")
    print(f"| schedule | {' | '.join(heads)} |")
    print("|---" * (len(heads) + 1) + "|")
    for row in compare_rows(n, ms):
        print(row)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return compare(args) if args.compare_torch else export(args)


if __name__ == "__main__":
    sys.exit(main())
