"""Turn a study's run results into its numbers (tables) and pictures (PNG plots).

PACI study: final loss of each schedule against 1F1B-flush at equal tokens, and the weight-version
drift each PACI run measured against the bound ceil((N-1-s)/a). Depth sweep: iterations to a
common target loss and the slowdown against P = 1, per optimizer.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from megatron.pipeline.schedules import schedule_class
from megatron.studies.metrics import iterations_to_target, relative_gap, slowdowns, trailing_mean, value_at

TARGET_FRACTION = 0.25  # the target is reached by every P = 1 run within this share of the budget


def smoothing_window(run: dict) -> int:
    return max(1, len(run["loss"]) // 20)


def smoothed(run: dict) -> list[float]:
    return trailing_mean(run["loss"], smoothing_window(run))


def _flag(run: dict, name: str) -> int:
    return int(run["argv"][run["argv"].index(name) + 1])


def accumulation(run: dict) -> int:
    """Micro-batches per update."""
    return _flag(run, "--global-batch-size") // _flag(run, "--micro-batch-size")


def learning_rate(run: dict) -> float:
    return float(run["argv"][run["argv"].index("--lr") + 1])


def paci_summary(runs: Sequence[dict]) -> dict:
    """Per peak LR: each schedule's final loss and its gap to that LR's 1F1B-flush (training loss
    smoothed over the last 5 % of updates, validation loss at the end), and measured drift
    against the bound ceil((N-1-s)/a)."""
    groups = []
    for lr in sorted({learning_rate(r) for r in runs}):
        group = [r for r in runs if learning_rate(r) == lr]
        flush = next(r for r in group if not asynchronous(r))  # the study's synchronous reference
        groups.append({"lr": lr, "rows": [_paci_row(r, flush) for r in group]})
    return {"depth": runs[0]["depth"], "groups": groups}


def asynchronous(run: dict) -> bool:
    """Whether the run's schedule steps stage-locally (the registry says, not its name)."""
    return schedule_class(run["schedule"]).traits.asynchronous


def _paci_row(run: dict, flush: dict) -> dict:
    train = smoothed(run)[-1]
    valid = run["eval"][-1]["loss"] if run["eval"] else math.nan
    a = accumulation(run)
    return {
        "method": run["method"], "schedule": run["schedule"], "a": a, "tokens": run["tokens"][-1],
        "train_loss": train, "train_gap": relative_gap(train, smoothed(flush)[-1]),
        "valid_loss": valid,
        "valid_gap": relative_gap(valid, flush["eval"][-1]["loss"]) if run["eval"] else math.nan,
        "drift_max": run["drift_max"],
        "drift_bound": [math.ceil((run["depth"] - 1 - s) / a) if asynchronous(run) else 0 for s in range(run["depth"])],
        "wall_s": run["wall_s"],
    }


def depth_summary(runs: Sequence[dict]) -> dict:
    """Iterations to the target loss and slowdown vs P = 1 for every (method, depth).

    The target is the highest smoothed loss any method's P = 1 run has at TARGET_FRACTION of the
    budget, so every P = 1 run reaches it early and slowdowns up to 1/TARGET_FRACTION are measured;
    a run that never reaches it is reported as above budget / base."""
    budget = max(r["iterations"][-1] for r in runs)
    base = [r for r in runs if r["depth"] == 1]
    target = max(value_at(r["iterations"], smoothed(r), TARGET_FRACTION * budget) for r in base)
    to_target: dict[str, dict[int, float | None]] = {}
    final: dict[str, dict[int, float]] = {}
    for r in runs:
        to_target.setdefault(r["method"], {})[r["depth"]] = iterations_to_target(r["iterations"], smoothed(r), target)
        final.setdefault(r["method"], {})[r["depth"]] = smoothed(r)[-1]
    return {"target_loss": target, "budget": budget, "iterations_to_target": to_target,
            "slowdown": slowdowns(to_target), "final_loss": final}


def _fmt_slowdown(summary: dict, method: str, depth: int) -> str:
    value = summary["slowdown"][method][depth]
    if value is not None:
        return f"{value:.2f}×"
    base = summary["iterations_to_target"][method].get(1)
    return f"> {summary['budget'] / base:.2f}×" if base else "n/a"


def paci_table(summary: dict) -> str:
    lines = [f"N = {summary['depth']} stages; gaps are relative to 1F1B-flush at the same LR and number of tokens.",
             "", "| peak LR | schedule | micro-batches per update (a) | tokens | train loss | gap | valid loss | gap | measured Δmax per stage | bound |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for group in summary["groups"]:
        for r in group["rows"]:
            lines.append(
                f"| {group['lr']:g} | {r['method']} | {r['a']} | {r['tokens']:,} | {r['train_loss']:.4f} "
                f"| {100 * r['train_gap']:+.2f} % | {r['valid_loss']:.4f} | {100 * r['valid_gap']:+.2f} % "
                f"| {_ints(r['drift_max'])} | {_ints(r['drift_bound'])} |")
    return "\n".join(lines)


def depth_tables(summary: dict) -> str:
    depths = sorted({p for by in summary["slowdown"].values() for p in by})
    head = "| method | " + " | ".join(f"P={p}" for p in depths) + " |"
    rule = "|---" * (len(depths) + 1) + "|"
    slow = [f"Slowdown (iterations to loss {summary['target_loss']:.3f} at P / at P=1; budget "
            f"{summary['budget']} iterations):", "", head, rule]
    final = ["Final training loss (smoothed):", "", head, rule]
    for method in summary["slowdown"]:
        slow.append(f"| {method} | " + " | ".join(_fmt_slowdown(summary, method, p) for p in depths) + " |")
        final.append(f"| {method} | " + " | ".join(f"{summary['final_loss'][method][p]:.3f}" for p in depths) + " |")
    return "\n".join(slow + [""] + final)


def _ints(values: Sequence[int]) -> str:
    return "[" + ",".join(str(v) for v in values) + "]"


# -- plots -------------------------------------------------------------------------------------

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_paci(runs: Sequence[dict], path: Path) -> None:
    """Per peak LR: training loss (smoothed, lines) and validation loss (markers) vs tokens."""
    plt = _pyplot()
    lrs = sorted({learning_rate(r) for r in runs})
    fig, axes = plt.subplots(1, len(lrs), figsize=(5.5 * len(lrs), 4.5), squeeze=False)
    for ax, lr in zip(axes.flat, lrs):
        for r in (r for r in runs if learning_rate(r) == lr):
            line, = ax.plot(r["tokens"], smoothed(r), label=r["method"], linewidth=1.1)
            ax.plot([e["tokens"] for e in r["eval"]], [e["loss"] for e in r["eval"]], marker="o", linestyle="none",
                    markersize=4, color=line.get_color())
        ax.set(title=f"N={runs[0]['depth']}, peak LR {lr:g}", xlabel="tokens", ylabel="loss (lines: train, dots: valid)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_depth(runs: Sequence[dict], summary: dict, loss_path: Path, slowdown_path: Path) -> None:
    """One panel of loss curves per method (a line per depth), and slowdown vs depth."""
    plt = _pyplot()
    methods = list(summary["slowdown"])
    cols = min(3, len(methods))
    rows = math.ceil(len(methods) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), sharey=True, squeeze=False)
    for ax, method in zip(axes.flat, methods):
        for r in sorted((r for r in runs if r["method"] == method), key=lambda r: r["depth"]):
            ax.plot(r["iterations"], smoothed(r), label=f"P={r['depth']}", linewidth=1.1)
        ax.axhline(summary["target_loss"], color="grey", linestyle=":", linewidth=1)
        ax.set(title=method, xlabel="iteration", ylabel="training loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(methods):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(loss_path, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for method in methods:
        points = sorted((p, s) for p, s in summary["slowdown"][method].items() if s is not None)
        line, = ax.plot([p for p, _ in points], [s for _, s in points], marker="o", label=method)
        base = summary["iterations_to_target"][method].get(1)
        censored = sorted(p for p, s in summary["slowdown"][method].items() if s is None)
        if base and censored:  # never reached: at least budget / base, drawn as an open triangle there
            ax.plot(censored, [summary["budget"] / base] * len(censored), marker="^", linestyle="none",
                    markerfacecolor="none", color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set(title=f"Slowdown to loss {summary['target_loss']:.3f} (async 1F1B; △: not reached, ≥)",
           xlabel="pipeline depth P",
           ylabel="iterations(P) / iterations(1)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(slowdown_path, dpi=110)
    plt.close(fig)
