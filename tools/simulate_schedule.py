"""Simulate a registered pipeline schedule with given op costs and report its bubble and memory.

    python tools/simulate_schedule.py --schedule zb-2p --stages 8 --microbatches 24 \\
        --t-f 18.522 --t-b 18.086 --t-w 9.337 --t-comm 0.601
    python tools/simulate_schedule.py --schedule paci --stages 4 --microbatches 2 --iterations 8 --json
    python tools/simulate_schedule.py --schedule zb-h1 --stages 4 --microbatches 8 --png zb_h1.png

Costs: ``--profile FILE.json`` (``{"t_f": .., "t_b": .., "t_w": .., "t_comm": .., "stages": [..]}``,
see ``megatron.pipeline.simulator.costs_from_profile``), then the ``--t-*`` flags override the
profile's values for every stage. Defaults: t_f = t_b = t_w = 1, t_comm = 0, t_bw = t_b + t_w,
t_opt = 0, m_w = M_W / M_B = 0.5, and the runtime terms t_send (the sender's time per message)
and t_sync (a synchronous step's collective) = 0; ``benchmarks/calibrate_runtime.py`` measures
them. ``--overlap-factor`` (DualPipeV) says how much of an F&B slot's forward and backward run
at once: 0 (F then B) to 1 (``max(F, B)``), see ``megatron.pipeline.overlap``.
``--microbatches`` is m per iteration for synchronous schedules and the accumulation factor a
for asynchronous ones (``--iterations`` then counts updates; the stream drains after the last
one).

Memory is in units of M_B (one micro-batch's activations on a stage); the bubble rate is Zero
Bubble's: (largest per-stage span - busy time) / largest per-stage span. ``--png`` needs
matplotlib (``pip install 'megatron-async[tools]'``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron.pipeline.ir import OpKind  # noqa: E402
from megatron.pipeline.replay import ScheduleError  # noqa: E402
from megatron.pipeline.schedules import (  # noqa: E402
    SCHEDULES, ScheduleConfig, ScheduleConfigError, ScheduleOptions, build_schedule, schedule_class)
from megatron.pipeline.schedules.config import options_as  # noqa: E402
from megatron.pipeline.schedules.zero_bubble.flags import ZeroBubbleOptions  # noqa: E402
from megatron.pipeline.simulator import (  # noqa: E402
    SimulationResult,
    costs_from_profile,
    load_profile,
    simulate_schedule,
)

COST_FLAGS = ("t_f", "t_b", "t_w", "t_bw", "t_comm", "t_opt", "t_send", "t_sync", "m_w")
COLORS = {
    OpKind.F: "#7fa7d9",
    OpKind.B: "#f2b880",
    OpKind.W: "#9fd39b",
    OpKind.BW: "#e99a9a",
    OpKind.OPT: "#b0b0b0",
}
MATPLOTLIB_MISSING = (
    "error: --png needs matplotlib, which is not installed; "
    "pip install 'megatron-async[tools]' (or pip install matplotlib)"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", choices=sorted(SCHEDULES))
    ap.add_argument("--torch-csv", default=None, metavar="PATH",
                    help="simulate the order of a torch.distributed.pipelining compute-only CSV instead of --schedule "
                         "(stages and micro-batches from the CSV; costs per chunk as for interleaved schedules)")
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--microbatches", type=int, default=None, help="m per iteration (a for async schedules)")
    ap.add_argument("--iterations", type=int, default=1, help="iterations (async: optimizer updates)")
    ap.add_argument("--chunks", type=int, default=1,
                    help="model chunks per stage (interleaved schedules; a V schedule always has 2)")
    for name in COST_FLAGS:
        ap.add_argument("--" + name.replace("_", "-"), type=float, default=None, dest=name)
    ap.add_argument("--profile", help="JSON file with (per-stage) costs")
    ap.add_argument("--memory-limit", type=float, default=None,
                    help="activation memory limit in units of M_B (zb-1p / zb-2p; default N or 2N)")
    ap.add_argument("--overlap-factor", type=float, default=0.0,
                    help="DualPipeV's F&B slots: how much of F and B runs concurrently, 0 (default: F then B, "
                         "as PyTorch without a custom overlap function and our executors) to 1 (max(F, B))")
    ap.add_argument("--json", action="store_true", help="print machine-readable JSON only")
    ap.add_argument("--png", help="draw the timeline to this file (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.torch_csv is not None:
        _from_torch_csv(ap, args)
    elif args.schedule is None or args.stages is None or args.microbatches is None:
        ap.error("--schedule, --stages and --microbatches are required (or --torch-csv PATH)")
    return args


def _from_torch_csv(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--torch-csv PATH``: the imported schedule ``torch-csv:PATH``, its ranks and micro-batches."""
    from megatron.pipeline.schedules import schedule_class

    if args.schedule is not None:
        ap.error("--torch-csv replaces --schedule; give one")
    args.schedule = f"torch-csv:{args.torch_csv}"
    try:
        order = schedule_class(args.schedule).order  # type: ignore[attr-defined]
    except ScheduleConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for flag, value in (("stages", order.num_ranks), ("microbatches", order.num_microbatches)):
        if getattr(args, flag) not in (None, value):
            ap.error(f"--{flag} {getattr(args, flag)}: the CSV has {value}")
        setattr(args, flag, value)


def build_costs(args: argparse.Namespace) -> dict[str, Any]:
    profile: dict[str, Any] = load_profile(args.profile) if args.profile else {}
    flags = {k: getattr(args, k) for k in COST_FLAGS if getattr(args, k) is not None}
    return {**profile, **flags}


def format_table(name: str, args: argparse.Namespace, result: SimulationResult, asynchronous: bool,
                 chunks: int = 1) -> str:
    unit = "updates" if asynchronous else "iterations"
    lines = [
        f"{name}: {args.stages} stages, {args.microbatches} micro-batches, {args.iterations} {unit}",
        "",
    ]
    header = f"{'stage':>5} {'busy':>12} {'span':>12} {'bubble':>12} {'bubble %':>9} {'peak mem (M_B)':>15}"
    if asynchronous:
        header += f" {'max drift':>10} {'weights':>8}"
    lines.append(header)
    for s in range(result.num_stages):
        row = (
            f"{s:>5} {result.busy[s]:>12.4f} {result.stage_span[s]:>12.4f} {result.bubble[s]:>12.4f} "
            f"{100 * result.stage_bubble_rate[s]:>8.2f}% {result.peak_memory[s]:>15.3f}"
        )
        if asynchronous:  # weight copies held (2BW's stash, PipeMare's delta): units of the stage's weights
            row += f" {result.max_drift[s]:>10d} {result.weight_memory[s]:>7.0f}x"
        lines.append(row)
    lines += [
        "",
        f"makespan     {result.makespan:.4f}",
        f"cost         {result.cost:.4f}  (largest per-stage span)",
        f"bubble rate  {result.bubble_rate:.4f}",
        f"peak memory  {max(result.peak_memory, default=0.0):.3f} M_B",
    ]
    if chunks > 1:  # costs and M_B are per chunk: a whole stage's activations are `chunks` of them
        lines.append(f"             {max(result.peak_memory, default=0.0) / chunks:.3f} whole-stage activations "
                     f"({chunks} chunks per stage)")
    if asynchronous:
        lines.append(f"max drift    {max(result.max_drift, default=0)}")
    return "\n".join(lines)


def draw_timeline(result: SimulationResult, path: str, title: str) -> None:
    """Paper-style timeline: one row per stage, one colored box per op, micro-batch inside;
    with several chunks per stage (interleaved, the V's two) the label is ``mb.chunk`` and a
    chunk > 0 box is hatched, so a V's way down (chunk 0) and back up (chunk 1) read apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = result.num_stages
    chunked = any(sp.op.chunk for spans in result.spans for sp in spans)
    makespan = result.makespan or 1.0
    ops = sum(len(s) for s in result.spans)
    width = min(60.0, max(8.0, ops / n * 0.35))
    fig, ax = plt.subplots(figsize=(width, 0.5 * n + 1.2))
    px_per_unit = width * 72 / makespan
    for s, spans in enumerate(result.spans):
        y = n - 1 - s
        for sp in spans:
            w = sp.end - sp.start
            kind = sp.op.kind
            if w <= 0:
                ax.plot([sp.start, sp.start], [y + 0.05, y + 0.95], color="black", linewidth=1.5)
                continue
            ax.add_patch(plt.Rectangle((sp.start, y + 0.05), w, 0.9, facecolor=COLORS[kind],
                                       edgecolor="black", linewidth=0.4, hatch="///" if sp.op.chunk else None))
            label = f"#{sp.op.update}" if kind is OpKind.OPT else str(sp.op.microbatch)
            if chunked and kind is not OpKind.OPT:
                label += f".{sp.op.chunk}"
            if w * px_per_unit >= 6 * len(label):
                ax.text(sp.start + w / 2, y + 0.5, label, ha="center", va="center", fontsize=6)
    ax.set_xlim(0, makespan)
    ax.set_ylim(0, n)
    ax.set_yticks([n - 1 - s + 0.5 for s in range(n)])
    ax.set_yticklabels([f"stage {s}" for s in range(n)])
    ax.set_xlabel("time")
    ax.set_title(title, fontsize=9)
    used = {sp.op.kind for spans in result.spans for sp in spans}
    ax.legend(handles=[Patch(facecolor=COLORS[k], edgecolor="black", label=k.value) for k in COLORS if k in used],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(used), fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(MATPLOTLIB_MISSING, file=sys.stderr)
            return 2
    try:
        costs = build_costs(args)
        options = ScheduleOptions(costs=costs_from_profile(costs, args.stages))
        if isinstance(options_as(options, schedule_class(args.schedule).traits.options), ZeroBubbleOptions):
            options = ZeroBubbleOptions(costs=options.costs)
            options = dataclasses.replace(options, memory_limit=args.memory_limit)
        config = ScheduleConfig(
            args.stages, args.microbatches, num_iterations=args.iterations, num_chunks=args.chunks, options=options
        )
        schedule = build_schedule(args.schedule, config)
        result = simulate_schedule(schedule, overlap=args.overlap_factor)
    except (ScheduleConfigError, ScheduleError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    asynchronous = schedule.traits.asynchronous
    chunks = schedule.layout.num_chunks
    if args.json:
        out = {
            "schedule": args.schedule,
            "microbatches": args.microbatches,
            "iterations": args.iterations,
            "chunks": chunks,  # whole-stage memory: peak_memory / chunks
            "asynchronous": asynchronous,
            "overlap_factor": args.overlap_factor,
            **result.to_dict(),
        }
        if args.memory_limit is not None or hasattr(schedule, "memory_limit"):
            out["memory_limit"] = getattr(schedule, "memory_limit", args.memory_limit)
        print(json.dumps(out, indent=2))
    else:
        print(format_table(args.schedule, args, result, asynchronous, chunks))
    if args.png:
        title = (f"{args.schedule}: N={args.stages}, m={args.microbatches}, "
                 f"bubble rate {result.bubble_rate:.4f}")
        draw_timeline(result, args.png, title)
        if not args.json:
            print(f"timeline written to {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
