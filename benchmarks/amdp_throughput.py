"""AMDP against 1F1B-flush and PipeDream-2BW in the timing simulator (paper Table 3's setting).

Same micro-batches per update T for every schedule, t_B = 2 t_F (AMDP's assumption), depth D
(default 8), T in {D, 2D, 4D}. Throughput is the simulator's steady state: the marginal time
of one update (``megatron.pipeline.simulator.steady_time_per_update``), as a ratio to
1F1B-flush and to 2BW. Two cost models: uniform stages (2BW is bubble-free there, so AMDP can
only tie it), and a last stage ``--heavy`` times slower (the LM head: the paper's GPT has 6 of
48 layers per stage at D = 8 plus a 50257 x 1600 head of ~2.4 layers, so about 1.4x), the
imbalance the paper credits for AMDP's lead over 2BW.

    python benchmarks/amdp_throughput.py                  # D = 8 (~10 s)
    python benchmarks/amdp_throughput.py --stages 4 6 8 --heavy 1.25
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron.pipeline.schedules import ScheduleConfig, build_schedule  # noqa: E402
from megatron.pipeline.costs.op_costs import OpCosts  # noqa: E402
from megatron.pipeline.simulator import steady_time_per_update  # noqa: E402

SCHEDULES = ("1f1b", "pipedream-2bw", "amdp")


def stage_costs(depth: int, heavy: float) -> list[OpCosts]:
    """t_F = 1, t_B = 2 on every stage; the last one ``heavy`` times that."""
    one = lambda x: OpCosts(t_f=x, t_b=2 * x, t_w=0, t_bw=2 * x)  # noqa: E731
    return [one(1.0)] * (depth - 1) + [one(heavy)]


def times(depth: int, window: int, heavy: float, iterations: int) -> dict[str, float]:
    """Steady-state time per update of each schedule."""
    costs = stage_costs(depth, heavy)
    return {name: steady_time_per_update(
        lambda i, name=name: build_schedule(name, ScheduleConfig(depth, window, num_iterations=i)), iterations, costs)
        for name in SCHEDULES}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[8])
    ap.add_argument("--heavy", type=float, default=1.4, help="last stage's cost relative to the others")
    ap.add_argument("--iterations", type=int, default=8, help="updates simulated (steady state: the second half)")
    args = ap.parse_args(argv)
    print("| D | T | last stage | 1F1B-flush | 2BW | AMDP | AMDP / 1F1B | 2BW / 1F1B | AMDP / 2BW |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d in args.stages:
        for heavy in (1.0, args.heavy):
            for t in (d, 2 * d, 4 * d):
                r = times(d, t, heavy, args.iterations)
                flush, tbw, ours = r["1f1b"], r["pipedream-2bw"], r["amdp"]
                print(f"| {d} | {t} | {heavy:g}x | {flush:g} | {tbw:g} | {ours:g} | {flush / ours:.3f} | "
                      f"{flush / tbw:.3f} | {tbw / ours:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
