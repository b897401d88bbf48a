"""Per-rank memory with and without recompute, across schedules and PP: measured vs modelled.

For every (PP, schedule, recompute) the emulator trains a small GPT (fp32, CPU, dropout 0.1)
and each stage (= rank of the distributed runtime, which the emulator equals bitwise) reports:

* **activations**: the worker's activation meter peak (bytes autograd saves, the unit inputs a
  checkpoint keeps, what a split backward keeps for W), next to the timing simulator's peak
  (units of ``M_B``) with ``m_f`` and ``m_w`` from ``megatron.pipeline.costs.activation_memory``
  (Korthikanti et al.'s per-layer formula), times ``M_B`` measured at the same PP without
  recompute under 1F1B (its stage 0 holds PP micro-batches); an interleaved op holds one
  chunk's share, ``M_B / chunks``;
* **tensors**: weights, gradients and optimizer state the stage holds after its run (bytes of
  its parameters, their ``.grad`` and ``StageAdamW.state_bytes()``), next to the closed formula
  ``parameters x (4 + 4 + 8)`` bytes (fp32 weight, gradient, AdamW's two moments) from the GPT's
  parameter count (``benchmarks/comm_volume.py``'s formula) and the schedule's weight copies.

``--distributed-optimizer DP`` is the hook for ZeRO-1 (``--use-distributed-optimizer``, being
added separately): it adds the modelled optimizer state sharded over DP replicas; it is refused
with one line while the trainer has no such flag. The measured side needs the distributed
runtime with DP > 1 (the emulator runs one replica): the optimizer-memory benchmark that comes
with that flag measures it.

    OMP_NUM_THREADS=1 python benchmarks/per_rank_memory.py                       # PP 2 and 4
    OMP_NUM_THREADS=1 python benchmarks/per_rank_memory.py --pp 2 --schedules 1f1b zb-h1
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.comm_volume import Model, part_params  # noqa: E402

#: the recompute configurations, by name (``--modes``)
RECOMPUTE_FLAGS = {
    "none": [],
    "selective": ["--recompute-granularity", "selective"],
    "full-block-1": ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"],
    "full-uniform-1": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "full-uniform-2": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
}

SCHEDULES = {"1f1b": 1, "gpipe": 1, "interleaved-1f1b": 2, "zb-h1": 1, "paci": 1}  # name -> chunks per stage
MODES = ("none", "selective", "full-uniform-1")
ADAMW_STATE_BYTES = 8  # two fp32 moments per parameter
DISTRIBUTED_OPTIMIZER_FLAG = "--use-distributed-optimizer"


def argv_for(model: Model, pp: int, schedule: str, mode: str) -> list[str]:
    chunks = SCHEDULES[schedule]
    extra = ["--num-layers-per-virtual-pipeline-stage", str(model.layers // (pp * chunks))] if chunks > 1 else []
    return ["--pipeline-executor", "emulator", "--pipeline-model-parallel-size", str(pp),
            "--num-layers", str(model.layers), "--hidden-size", str(model.hidden), "--num-attention-heads",
            str(model.heads), "--seq-length", str(model.seq), "--vocab-size", str(model.vocab),
            "--micro-batch-size", str(model.micro_batch), "--global-batch-size",
            str(model.micro_batch * model.microbatches), "--train-iters", str(model.iters),
            "--log-interval", str(model.iters), "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
            "--device", "cpu", "--pipeline-schedule", schedule, "--log-activation-memory", *extra, *RECOMPUTE_FLAGS[mode]]


def measure(model: Model, pp: int, schedule: str, mode: str) -> tuple[list[int], list[int]]:
    """Per stage: peak activation bytes, and weight + gradient + optimizer-state bytes."""
    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.loop.training import emulate
    from megatron.trainer.tasks.gpt import GPTTask

    with contextlib.redirect_stdout(io.StringIO()):
        workers = emulate(GPTTask(), parse_run_plan(argv_for(model, pp, schedule, mode), build_parser()))
    tensors = []
    for w in workers:
        params = [p for chunk in w.setup.chunks for p in chunk.parameters()]
        held = sum(p.numel() * p.element_size() for p in params)
        held += sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        tensors.append(held + w.setup.optimizer.state_bytes())
    return [w.meter.run_peak_bytes for w in workers], tensors


def modelled_activations(model: Model, pp: int, schedule: str, mode: str, m_b: float) -> list[float]:
    """Simulator peak (units of one op's ``M_B``) times ``M_B`` per op, per stage."""
    from megatron.pipeline.costs.activation_memory import LayerShape, recompute_costs
    from megatron.pipeline.schedules import ScheduleConfig, build_schedule
    from megatron.pipeline.costs.op_costs import OpCosts
    from megatron.pipeline.simulator import simulate_schedule

    chunks = SCHEDULES[schedule]
    shape = LayerShape(model.seq, model.micro_batch, model.hidden, model.heads)
    flags = RECOMPUTE_FLAGS[mode]
    granularity = flags[1] if flags else None
    method = flags[3] if len(flags) > 3 else None
    n = int(flags[5]) if len(flags) > 5 else None
    base = OpCosts(m_w=shape.weight_grad_bytes() / shape.layer_bytes())
    costs = recompute_costs(base, shape, model.layers // (pp * chunks), granularity, method, n)
    config = ScheduleConfig(num_stages=pp, num_microbatches=model.microbatches, num_iterations=1, num_chunks=chunks)
    result = simulate_schedule(build_schedule(schedule, config), costs)
    return [peak * m_b / chunks for peak in result.peak_memory]


def modelled_tensors(model: Model, pp: int, schedule: str, dp_shards: int = 1) -> list[float]:
    """``parameters x (4 weight + 4 gradient + 8 / dp_shards AdamW state)`` per stage, plus the
    schedule's extra weight copies (2BW, PipeMare)."""
    from megatron.pipeline.schedules import ScheduleConfig, schedule_class

    chunks = SCHEDULES[schedule]
    parts = pp * chunks
    config = ScheduleConfig(num_stages=pp, num_microbatches=model.microbatches, num_chunks=chunks)
    weight_copies = schedule_class(schedule).traits.policy_for(config).weight_copies
    out = []
    for stage in range(pp):
        n = sum(part_params(model, c * pp + stage, parts, model.vocab) for c in range(chunks))
        copies = weight_copies[stage]
        out.append(n * (4 * copies + 4 + ADAMW_STATE_BYTES / dp_shards))
    return out


def check_distributed_optimizer(model: Model, dp: int | None) -> None:
    """The ZeRO-1 hook: refused (one line) while the trainer refuses ``--use-distributed-optimizer``
    (asked by parsing a DP run with it, so the hook opens by itself when the flag works)."""
    if dp is None:
        return
    if dp < 2:
        sys.exit("error: --distributed-optimizer needs DP >= 2 (the replicas the state is sharded over)")
    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_args

    argv = [a for a in argv_for(model, 2, "1f1b", "none") if a not in ("--pipeline-executor", "emulator")]
    argv[argv.index("--global-batch-size") + 1] = str(model.micro_batch * model.microbatches * dp)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parse_args([*argv, DISTRIBUTED_OPTIMIZER_FLAG, "--data-parallel-size", str(dp)], build_parser())
    except SystemExit:
        refusal = stderr.getvalue().strip().splitlines()[-1:] or ["refused"]
        sys.exit(f"error: --distributed-optimizer: the trainer refuses {DISTRIBUTED_OPTIMIZER_FLAG} ({refusal[0]}); "
                 "this column is refused until it works")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, nargs="*", default=[2, 4])
    p.add_argument("--schedules", nargs="*", default=list(SCHEDULES), choices=list(SCHEDULES))
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=list(RECOMPUTE_FLAGS))
    defaults = Model(hidden=64, heads=4, seq=128, iters=1)
    for field, value in vars(defaults).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=value)
    p.add_argument("--distributed-optimizer", type=int, default=None, metavar="DP",
                   help="add the modelled ZeRO-1 optimizer state over DP replicas (needs --use-distributed-optimizer)")
    p.add_argument("--json", default=None)
    opts = p.parse_args()
    warnings.filterwarnings("ignore")
    model = Model(**{field: getattr(opts, field) for field in vars(defaults)})
    check_distributed_optimizer(model, opts.distributed_optimizer)
    print(f"GPT {model.layers} layers, h {model.hidden}, a {model.heads}, s {model.seq}, b {model.micro_batch}, "
          f"m {model.microbatches}, V {model.vocab}, fp32, dropout 0.1, emulator; MiB measured / modelled")
    zero = f" {'ZeRO-1 model':>12}" if opts.distributed_optimizer else ""
    print(f"{'PP':>2} {'schedule':17} {'recompute':15} {'st':>2} {'activations':>19} {'ratio':>6} "
          f"{'weights+grads+optim':>21} {'ratio':>6}{zero}")
    rows: list[dict[str, Any]] = []
    for pp in opts.pp:
        m_b = None
        for schedule in opts.schedules:
            tensor_model = modelled_tensors(model, pp, schedule)
            sharded = modelled_tensors(model, pp, schedule, opts.distributed_optimizer or 1)
            for mode in opts.modes:
                acts, tensors = measure(model, pp, schedule, mode)
                if m_b is None:
                    m_b = (acts[0] if (schedule, mode) == ("1f1b", "none") else
                           measure(model, pp, "1f1b", "none")[0][0]) / pp
                act_model = modelled_activations(model, pp, schedule, mode, m_b)
                for stage in range(pp):
                    row = {"pp": pp, "schedule": schedule, "recompute": mode, "stage": stage,
                           "activation_bytes": acts[stage], "activation_model": act_model[stage],
                           "tensor_bytes": tensors[stage], "tensor_model": tensor_model[stage],
                           "zero1_model": sharded[stage] if opts.distributed_optimizer else None}
                    rows.append(row)
                    extra = f" {sharded[stage] / 2**20:>12.2f}" if opts.distributed_optimizer else ""
                    print(f"{pp:>2} {schedule:17} {mode:15} {stage:>2} {acts[stage] / 2**20:>8.2f} / "
                          f"{act_model[stage] / 2**20:<8.2f} {acts[stage] / act_model[stage]:>6.2f} "
                          f"{tensors[stage] / 2**20:>9.2f} / {tensor_model[stage] / 2**20:<9.2f} "
                          f"{tensors[stage] / tensor_model[stage]:>6.3f}{extra}", flush=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps({"model": vars(model), "m_b_bytes": m_b, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
