"""Step 4(a): the baseline the runtime's overhead is measured against. A plain training loop
over the same megatron-core ``GPTModel`` the trainer builds (one stage holding every layer,
built by the project's ``GPTTask.build_stage`` so the layer spec, dtype and initialisation are
the trainer's), the same mock batches and loss: per iteration, forward and backward of every
micro-batch (gradients accumulate), then one step of torch's fused AdamW on the bf16 weights.
No pipeline, no stage worker, no fp32 master copy (the trainer keeps one; its update costs a
few ms per iteration at GPT-2 medium size, next to ~100 ms of forward and backward).

    python -m benchmarks.gpucheck.plain_loop WARMUP -- PRETRAIN_GPT_FLAGS...

prints one JSON line: losses, median tokens/s over the iterations after WARMUP, CUDA peak.
"""
from __future__ import annotations

import datetime
import json
import statistics
import sys
import time


def main(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.tasks.gpt import GPTTask

    warmup, flags = int(argv[0]), argv[argv.index("--") + 1:]
    task = GPTTask()
    parser = build_parser()
    task.add_arguments(parser)
    config = parse_run_plan(flags, parser)
    optim, training = config.optimizer, config.training
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(minutes=5))
    parallel_state.initialize_model_parallel(1, 1)
    device = torch.device("cuda" if config.launch.device == "cuda" or (config.launch.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    (model,) = task.build_stage(config, 0, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay,
                                  betas=(optim.adam_beta1, optim.adam_beta2), eps=optim.adam_eps,
                                  fused=device.type == "cuda")
    micro = training.global_batch_size // training.micro_batch_size
    batches = task.batch_fn(config, 0, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    losses, seconds = [], []
    for it in range(training.train_iters):
        sync()
        start = time.perf_counter()
        total = 0.0
        for m in range(micro):
            batch = batches(it * micro + m)
            loss, _ = task.loss_fn(model(None, batch), batch)
            (loss / micro).backward()
            total += loss.item() / micro
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        seconds.append(time.perf_counter() - start)
        losses.append(total)
    tokens = training.global_batch_size * config.model.seq_length
    out = {"losses": losses, "tokens_per_s": tokens / statistics.median(seconds[warmup:] or seconds)}
    if device.type == "cuda":
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
