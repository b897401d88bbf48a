"""Per-rank memory with and without ``--use-distributed-optimizer`` and ``--recompute-granularity full``.

Runs a GPT through the distributed runtime (PP x DP gloo ranks on this machine, each rank in a
process of its own) in four configurations and prints, per rank, side by side:

* optimizer bytes: the stage optimizer's AdamW moments plus fp32 masters (``state_bytes``,
  counted from the tensors it holds), next to the analytic model ``P_stage x (8 + 4 [bf16
  masters]) / DP`` (``/ DP`` with the distributed optimizer; ZeRO-1's saving);
* peak activation bytes (the worker's activation meter) next to the simulator's model (the
  1F1B peak in micro-batches times M_B from the per-layer formula of
  ``megatron.pipeline.costs.activation_memory``, with the full-recompute costs);
* peak RSS of the rank's process (``ru_maxrss``: includes Python, torch and the model, so only
  differences between rows mean something).

    python benchmarks/optimizer_memory.py                 # PP 2 x DP 2, 4 layers, h 512, bf16
    python benchmarks/optimizer_memory.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CONFIGS = {
    "replicated": [],
    "distributed-optimizer": ["--use-distributed-optimizer"],
    "replicated + full recompute": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                    "--recompute-num-layers", "1"],
    "distributed-optimizer + full recompute": ["--use-distributed-optimizer", "--recompute-granularity", "full",
                                               "--recompute-method", "uniform", "--recompute-num-layers", "1"],
}


def _argv(opts: argparse.Namespace, extra: list[str]) -> list[str]:
    return ["--pipeline-model-parallel-size", str(opts.stages), "--data-parallel-size", str(opts.dp),
            "--num-layers", str(opts.layers), "--hidden-size", str(opts.hidden), "--num-attention-heads",
            str(opts.heads), "--seq-length", str(opts.seq), "--vocab-size", str(opts.vocab),
            "--micro-batch-size", "1", "--global-batch-size", str(opts.dp * opts.microbatches),
            "--train-iters", str(opts.iters), "--log-interval", str(opts.iters), "--device", "cpu",
            "--num-threads", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--pipeline-schedule", "1f1b", "--log-activation-memory", *(["--bf16"] if opts.bf16 else []),
            # an even split: the default balanced split moves layers when recompute changes the costs
            "--pipeline-layer-split", *[str(opts.layers // opts.stages)] * opts.stages, *extra]


def _rank(rank: int, world: int, port: int, argv: list[str], out: str) -> None:
    """One rank: the runtime's own set-up (groups, transport, drive), then this rank's numbers."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    warnings.filterwarnings("ignore")
    import contextlib
    import io
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from megatron.pipeline.runtime.parallel import RankLayout, StageGroups
    from megatron.pipeline.runtime.transport.distributed import DistributedTransport
    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.loop.training import _init_megatron_parallel_state, drive
    from megatron.trainer.tasks.gpt import GPTTask

    torch.set_num_threads(1)
    task = GPTTask()
    parser = build_parser()
    task.add_arguments(parser)
    config = parse_run_plan(argv, parser)
    timeout = timedelta(seconds=config.launch.pipeline_timeout_seconds)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    parallel = config.parallel
    groups = StageGroups.create(RankLayout(parallel.pipeline_model_parallel_size, parallel.data_parallel_size),
                                timeout, config.run.layout)
    _init_megatron_parallel_state()
    transport = DistributedTransport(groups, config.run.layout, timeout)
    with contextlib.redirect_stdout(io.StringIO()):
        (worker,) = drive(task, config, transport, torch.device("cpu"), None)
    params = worker.setup.optimizer.parameters()
    row = {"rank": rank, "stage": worker.stage, "dp_rank": transport.dp_rank,
           "stage_params": sum(p.numel() for p in params),
           "param_bytes": sum(p.numel() * p.element_size() for p in params),
           "optimizer_bytes": worker.setup.optimizer.state_bytes(),
           "activation_peak_bytes": worker.meter.run_peak_bytes,
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    Path(out, f"rank{rank}.json").write_text(json.dumps(row))
    dist.barrier(group=groups.reports)
    dist.destroy_process_group()


def measure(opts: argparse.Namespace, extra: list[str]) -> list[dict]:
    import torch.multiprocessing as mp

    from megatron.trainer.launch.launcher import free_port

    world = opts.stages * opts.dp
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(world, free_port(), _argv(opts, extra), out), nprocs=world, join=True,
                           start_method="spawn")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def optimizer_model(stage_params: int, bf16: bool, dp: int, sharded: bool) -> float:
    """AdamW's two fp32 moments, plus an fp32 master for bf16 parameters; ZeRO-1 divides by DP."""
    return stage_params * (8 + (4 if bf16 else 0)) / (dp if sharded else 1)


def activation_model(opts: argparse.Namespace, recompute: bool) -> list[float]:
    """The simulator's 1F1B peak per stage (units of M_B) times M_B from the per-layer formula."""
    from megatron.pipeline.costs.activation_memory import LayerShape, recompute_costs
    from megatron.pipeline.schedules import ScheduleConfig, build_schedule
    from megatron.pipeline.costs.op_costs import OpCosts
    from megatron.pipeline.simulator import simulate_schedule

    shape = LayerShape(opts.seq, 1, opts.hidden, opts.heads)
    layers = opts.layers // opts.stages
    base = OpCosts(m_w=shape.weight_grad_bytes() / shape.layer_bytes())
    costs = recompute_costs(base, shape, layers, "full" if recompute else None, "uniform" if recompute else None,
                            1 if recompute else None)
    config = ScheduleConfig(num_stages=opts.stages, num_microbatches=opts.microbatches, num_iterations=1)
    peaks = simulate_schedule(build_schedule("1f1b", config), costs).peak_memory
    bytes_per_mb = shape.layer_bytes() * layers * (2 if opts.bf16 else 4) / 2  # the formula counts 2-byte values
    return [peak * bytes_per_mb for peak in peaks]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--fp32", dest="bf16", action="store_false", help="fp32 parameters (default bf16)")
    p.add_argument("--json", default=None)
    opts = p.parse_args()
    rows = []
    mib = 2**20
    print(f"GPT {opts.layers} layers, h {opts.hidden}, vocab {opts.vocab}, s {opts.seq}, PP {opts.stages} x DP "
          f"{opts.dp}, 1f1b, m {opts.microbatches}, {'bf16' if opts.bf16 else 'fp32'}, CPU gloo; MiB")
    print(f"{'configuration':40} {'rank':>4} {'stage':>5} {'optimizer meas/model':>21} "
          f"{'activation peak meas/model':>27} {'peak RSS':>9}")
    for name, extra in CONFIGS.items():
        sharded = "--use-distributed-optimizer" in extra
        recompute = "--recompute-granularity" in extra
        act_model = activation_model(opts, recompute)
        for row in measure(opts, extra):
            model = optimizer_model(row["stage_params"], opts.bf16, opts.dp, sharded)
            row.update(configuration=name, optimizer_model_bytes=model,
                       activation_model_bytes=act_model[row["stage"]])
            rows.append(row)
            print(f"{name:40} {row['rank']:>4} {row['stage']:>5} "
                  f"{row['optimizer_bytes'] / mib:>9.2f} / {model / mib:<9.2f} "
                  f"{row['activation_peak_bytes'] / mib:>13.2f} / {row['activation_model_bytes'] / mib:<11.2f} "
                  f"{row['peak_rss_bytes'] / mib:>9.1f}")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"config": vars(opts), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
