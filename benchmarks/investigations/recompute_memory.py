"""Per-stage peak activation memory with no / selective / full recompute: measured and modelled.

Measured: the stage workers' activation meter (bytes autograd saves per micro-batch, plus what
a checkpoint keeps and what a split backward keeps for W), peak over a short emulator run of a
GPT (fp32, CPU, dropout on) under 1f1b and zb-h1 (B/W split).

Modelled: the timing simulator's peak (units of M_B) with ``m_f`` from
``megatron.pipeline.costs.activation_memory`` (Korthikanti et al.'s per-layer formula) and ``m_w``
from the same formula, times M_B measured without recompute (1f1b: its stage-0 peak divided by
the micro-batches it holds; the embedding's and head's few tensors ride along).

    python benchmarks/investigations/recompute_memory.py               # 4 stages, 8 layers, h 128, s 256
    python benchmarks/investigations/recompute_memory.py --json out.json
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.per_rank_memory import RECOMPUTE_FLAGS as MODES  # noqa: E402

SCHEDULES = ("1f1b", "zb-h1")


def measure(opts: argparse.Namespace, schedule: str, mode: str) -> list[int]:
    """Per-stage peak activation bytes of one emulator run."""
    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_args
    from megatron.trainer.loop.training import emulate
    from megatron.trainer.tasks.gpt import GPTTask

    argv = ["--pipeline-executor", "emulator", "--pipeline-model-parallel-size", str(opts.stages),
            "--num-layers", str(opts.layers), "--hidden-size", str(opts.hidden), "--num-attention-heads",
            str(opts.heads), "--seq-length", str(opts.seq), "--vocab-size", "512", "--micro-batch-size",
            str(opts.micro_batch), "--global-batch-size", str(opts.micro_batch * opts.microbatches),
            "--train-iters", str(opts.iters), "--log-interval", str(opts.iters), "--hidden-dropout", "0.1",
            "--attention-dropout", "0.1", "--device", "cpu", "--pipeline-schedule", schedule, "--log-activation-memory", *MODES[mode]]
    with contextlib.redirect_stdout(io.StringIO()):
        workers = emulate(GPTTask(), parse_args(argv, build_parser()))
    return [w.meter.run_peak_bytes for w in workers]


def model(opts: argparse.Namespace, schedule: str, mode: str, m_b: float) -> list[float]:
    """Simulator peak (units of M_B) times the measured M_B, per stage."""
    from megatron.pipeline.costs.activation_memory import LayerShape, recompute_costs
    from megatron.pipeline.schedules import ScheduleConfig, build_schedule
    from megatron.pipeline.costs.op_costs import OpCosts
    from megatron.pipeline.simulator import simulate_schedule

    shape = LayerShape(opts.seq, opts.micro_batch, opts.hidden, opts.heads)
    layers = opts.layers // opts.stages
    flags = MODES[mode]
    granularity = flags[1] if flags else None
    method = flags[3] if len(flags) > 3 else None
    n = int(flags[5]) if len(flags) > 5 else None
    base = OpCosts(m_w=shape.weight_grad_bytes() / shape.layer_bytes())
    costs = recompute_costs(base, shape, layers, granularity, method, n)
    config = ScheduleConfig(num_stages=opts.stages, num_microbatches=opts.microbatches, num_iterations=1)
    result = simulate_schedule(build_schedule(schedule, config), costs)
    return [peak * m_b for peak in result.peak_memory]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--json", default=None)
    opts = p.parse_args()
    warnings.filterwarnings("ignore")
    measured = {(s, mode): measure(opts, s, mode) for s in SCHEDULES for mode in MODES}
    m_b = measured[("1f1b", "none")][0] / opts.stages  # 1f1b stage 0 holds N micro-batches
    rows = []
    print(f"GPT {opts.layers} layers on {opts.stages} stages, h {opts.hidden}, a {opts.heads}, s {opts.seq}, "
          f"b {opts.micro_batch}, m {opts.microbatches}, fp32, dropout 0.1; M_B (measured) {m_b / 2**20:.2f} MiB")
    print(f"{'schedule':9} {'recompute':15} " + " ".join(f"{'stage ' + str(s) + ' meas/model MiB':>26}"
                                                         for s in range(opts.stages)))
    for (schedule, mode), peaks in measured.items():
        predicted = model(opts, schedule, mode, m_b)
        rows.append({"schedule": schedule, "recompute": mode, "measured_bytes": peaks, "model_bytes": predicted})
        cells = " ".join(f"{a / 2**20:>12.2f} / {b / 2**20:<11.2f}" for a, b in zip(peaks, predicted))
        print(f"{schedule:9} {mode:15} {cells}")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"config": vars(opts), "m_b_bytes": m_b, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
