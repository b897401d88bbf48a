"""The planner's throughput ratios against the Zero Bubble paper's measurements (issue 32).

Given the paper's profiled costs (Table 6: T_F, T_B, T_W, T_comm per setting, the same on every
stage), the planner's simulated ZB-1p/1F1B and ZB-2p/1F1B throughput ratios (the marginal
iteration, :func:`megatron.pipeline.planner.evaluate.steady_span`) are printed next to the
measured ratios of Table 4 (samples per GPU per second), and its PACI/1F1B ratio next to PACI
Table 2's (projected there from the same 1F1B measurements). No optimizer step is modelled (t_opt =
0): the gap it explains is discussed in ``docs/planning.md``.

    python benchmarks/planner_papers.py [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron.pipeline.planner.candidates import Candidate  # noqa: E402
from megatron.pipeline.planner.evaluate import steady_span  # noqa: E402
from megatron.pipeline.schedules import build_schedule  # noqa: E402
from megatron.pipeline.op_costs import OpCosts  # noqa: E402
from megatron.pipeline.simulator import simulate_schedule  # noqa: E402

# (model, p, m, T_F, T_B, T_W, T_comm) -- Table 6; Table 4: ZB-2p, ZB-1p, 1F1B samples/GPU/s
ZB_TABLE6 = [
    ("1.5B", 8, 24, 18.522, 18.086, 9.337, 0.601), ("1.5B", 8, 32, 18.513, 18.086, 9.331, 0.626),
    ("1.5B", 8, 64, 18.546, 18.097, 9.321, 0.762), ("6.2B", 8, 24, 29.718, 29.444, 19.927, 0.527),
    ("6.2B", 8, 32, 29.802, 29.428, 19.530, 0.577), ("6.2B", 8, 64, 29.935, 29.621, 19.388, 0.535),
    ("14.6B", 16, 48, 11.347, 11.248, 8.132, 0.377), ("14.6B", 16, 64, 11.307, 11.254, 8.101, 0.379),
    ("14.6B", 16, 128, 11.325, 11.308, 8.109, 0.378), ("28.3B", 32, 96, 10.419, 10.207, 7.715, 0.408),
    ("28.3B", 32, 128, 10.408, 10.204, 7.703, 0.408), ("28.3B", 32, 256, 10.402, 10.248, 7.698, 0.460),
]
#: PACI Table 2, PACI samples/GPU/s in ZB_TABLE6's order (its 1F1B-Flush row is ZB Table 4's; the
#: paper's PACI is a projection, Eq. 5: 1F1B-Flush x (m + N - 1) / m, the inverse bubble efficiency)
PACI_TABLE2 = [15.24, 15.23, 15.09, 4.52, 4.51, 4.47, 1.84, 1.84, 1.83, 1.01, 0.99, 0.99]
ZB_TABLE4 = [(14.5, 12.9, 11.8), (14.8, 13.4, 12.5), (14.9, 14.2, 13.6), (4.32, 3.88, 3.50), (4.35, 4.00, 3.70),
             (4.39, 4.20, 4.03), (1.81, 1.61, 1.40), (1.83, 1.67, 1.49), (1.85, 1.76, 1.64), (0.99, 0.87, 0.76),
             (1.00, 0.90, 0.80), (1.00, 0.96, 0.88)]


def iteration_ms(schedule: str, p: int, m: int, costs: OpCosts) -> float:
    """The planner's iteration: the marginal one, a flush at every synchronous step."""
    cand = Candidate(schedule, p, 1, m, 1, "none", "even", (1,) * p)
    return steady_span(cand, [costs] * p, 1)[0]


def overlapped_ms(schedule: str, p: int, m: int, costs: OpCosts) -> float:
    """One iteration's largest per-stage span (the paper's Table 5 cost): what an iteration costs
    when the step does not flush the pipeline (post-validation lets the next iteration's first
    stages start while the last ones finish)."""
    cand = Candidate(schedule, p, 1, m, 1, "none", "even", (1,) * p)
    return simulate_schedule(build_schedule(schedule, cand.config(1, {"costs": (costs,) * p}))).cost


def rows() -> list[dict]:
    out = []
    for (model, p, m, tf, tb, tw, tc), (zb2, zb1, ofob), paci in zip(ZB_TABLE6, ZB_TABLE4, PACI_TABLE2):
        costs = OpCosts(t_f=tf, t_b=tb, t_w=tw, t_comm=tc)
        t = {s: iteration_ms(s, p, m, costs) for s in ("1f1b", "zb-1p", "zb-2p", "paci")}
        o = {s: overlapped_ms(s, p, m, costs) for s in ("1f1b", "zb-2p")}
        out.append({"model": model, "p": p, "m": m,
                    "planner_zb1p_over_1f1b": t["1f1b"] / t["zb-1p"], "paper_zb1p_over_1f1b": zb1 / ofob,
                    "planner_zb2p_over_1f1b": t["1f1b"] / t["zb-2p"], "paper_zb2p_over_1f1b": zb2 / ofob,
                    "overlapped_zb2p_over_1f1b": o["1f1b"] / o["zb-2p"],
                    "planner_paci_over_1f1b": t["1f1b"] / t["paci"], "paper_paci_over_1f1b": paci / ofob})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    results = rows() if not ap.parse_args(argv).json else None
    if results is None:
        print(json.dumps(rows(), indent=1))
        return 0
    print(f"{'model':>6} {'p':>3} {'m':>4} | {'ZB-1p/1F1B plan':>15} {'paper':>6} {'gap':>6} | "
          f"{'ZB-2p/1F1B plan':>15} {'paper':>6} {'gap':>6} | {'overlapped':>10} {'gap':>6} | "
          f"{'PACI/1F1B plan':>14} {'paper':>6} {'gap':>6}")
    for r in results:
        g1 = r["planner_zb1p_over_1f1b"] / r["paper_zb1p_over_1f1b"] - 1
        g2 = r["planner_zb2p_over_1f1b"] / r["paper_zb2p_over_1f1b"] - 1
        print(f"{r['model']:>6} {r['p']:>3} {r['m']:>4} | {r['planner_zb1p_over_1f1b']:>15.3f} "
              f"{r['paper_zb1p_over_1f1b']:>6.3f} {100 * g1:>5.1f}% | {r['planner_zb2p_over_1f1b']:>15.3f} "
              f"{r['paper_zb2p_over_1f1b']:>6.3f} {100 * g2:>5.1f}% | {r['overlapped_zb2p_over_1f1b']:>10.3f} "
              f"{100 * (r['overlapped_zb2p_over_1f1b'] / r['paper_zb2p_over_1f1b'] - 1):>5.1f}% | "
              f"{r['planner_paci_over_1f1b']:>14.3f} {r['paper_paci_over_1f1b']:>6.3f} "
              f"{100 * (r['planner_paci_over_1f1b'] / r['paper_paci_over_1f1b'] - 1):>5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
