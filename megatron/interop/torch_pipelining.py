"""``torch.distributed.pipelining`` on our side: its schedules' orders, and its runtime over our stages.

* :func:`torch_order` / :func:`torch_order_csv`: the compute order one of torch's schedule
  classes builds (``pipeline_order``) for ``N`` ranks and ``m`` micro-batches, without a process
  group (the classes only read the stages' indices and group size to build it), as torch's
  compute-only CSV (:mod:`megatron.pipeline.torch_actions` reads it back).
* :func:`rank_parts`: which model parts (torch stage indices) a rank holds in each placement.
* :func:`train_torch_runtime`: inside an initialised process group, one rank of torch's
  ``_PipelineScheduleRuntime`` running a compute-only CSV over **our** GPT stages
  (``GPTTask.build_stage`` of the job config, so the same parts, layers and init by global
  name as our runtime), our micro-batches (``batch_fn``: the same samples in the same
  micro-batch), Megatron's per-micro-batch loss ``sum(loss * mask) / sum(mask)``, and the
  optimizer our ``--adam-kernel single-tensor`` runs (``torch.optim.AdamW(foreach=False)``; no
  clipping, no weight decay, constant rate: the job config must say so, see
  :data:`COMPARABLE_FLAGS`). Only the runtime and its order differ from our run.
"""
from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch

#: torch's seven schedule classes, and the placement each runs on
TORCH_SCHEDULES: dict[str, str] = {
    "ScheduleGPipe": "chain",
    "Schedule1F1B": "chain",
    "ScheduleInterleaved1F1B": "loop",
    "ScheduleLoopedBFS": "loop",
    "ScheduleInterleavedZeroBubble": "loop",
    "ScheduleZBVZeroBubble": "v",
    "ScheduleDualPipeV": "v",
}

#: trainer flags that make our run's optimizer the one :func:`train_torch_runtime` applies
COMPARABLE_FLAGS = ["--adam-kernel", "single-tensor", "--weight-decay", "0", "--clip-grad", "0",
                    "--lr-warmup-iters", "0", "--lr-decay-style", "constant",
                    "--hidden-dropout", "0", "--attention-dropout", "0"]


def rank_parts(placement: str, rank: int, world: int, per_rank: int = 2) -> list[int]:
    """torch's stage indices on ``rank``: chain ``[r]``; loop ``r, r + N, ...``; V ``r, 2N - 1 - r``."""
    if placement == "chain":
        return [rank]
    if placement == "v":
        return [rank, 2 * world - 1 - rank]
    return [rank + c * world for c in range(per_rank)]


def torch_order(schedule: str, num_ranks: int, num_microbatches: int) -> dict[int, list[str]]:
    """Per rank, the compute actions torch's ``schedule`` class orders (idle steps and its
    REDUCE_GRAD bookkeeping dropped; DualPipeV's overlapped slots kept as ``(a;b)OVERLAP_F_B``)."""
    from torch.distributed.pipelining import schedules as S

    cls = getattr(S, schedule)
    placement = TORCH_SCHEDULES[schedule]
    parts = num_ranks if placement == "chain" else 2 * num_ranks

    def fake(index: int, rank: int) -> Any:
        return types.SimpleNamespace(stage_index=index, num_stages=parts, group_size=num_ranks, group_rank=rank,
                                     is_first=index == 0, is_last=index == parts - 1, submod=torch.nn.Identity())

    if schedule == "Schedule1F1B":
        return {rank: _schedule_1f1b_order(rank, num_ranks, num_microbatches) for rank in range(num_ranks)}
    loss = lambda output, target: output  # noqa: E731 - never called
    if placement == "chain":
        order = cls(fake(0, 0), n_microbatches=num_microbatches, loss_fn=loss).pipeline_order
    else:
        order = cls([fake(i, 0) for i in rank_parts(placement, 0, num_ranks)], n_microbatches=num_microbatches,
                    loss_fn=loss).pipeline_order
    return {rank: [str(a) for a in actions if a is not None and a.is_compute_op]
            for rank, actions in sorted(order.items())}


def _schedule_1f1b_order(rank: int, num_ranks: int, num_microbatches: int) -> list[str]:
    """The order ``Schedule1F1B._step_microbatches`` runs on ``rank``: ``min(m, N - r)`` warm-up
    forwards, then a backward and the next forward in turn, then the remaining backwards.

    Not its ``pipeline_order`` (``_get_pipeline_order``, informational: ``step()`` never reads
    it), which in torch 2.13 numbers the last rank's steady-state forwards from 1, so its last
    rank runs ``F1 .. F{m}`` and never ``F0`` (our import refuses that order: "stage N-1 never
    runs F0"... and an ``F{m}``)."""
    m = num_microbatches
    warmup = min(m, num_ranks - rank)
    out = [f"{rank}F{i}" for i in range(warmup)]
    fwd, bwd = warmup, 0
    while True:
        out.append(f"{rank}B{bwd}")
        bwd += 1
        if fwd == m:
            break
        out.append(f"{rank}F{fwd}")
        fwd += 1
    out += [f"{rank}B{i}" for i in range(bwd, m)]
    return out


def torch_order_csv(schedule: str, num_ranks: int, num_microbatches: int) -> str:
    order = torch_order(schedule, num_ranks, num_microbatches)
    return "".join(",".join(order[r]) + "\n" for r in range(num_ranks))


def train_torch_runtime(argv: Sequence[str], csv_path: str, rank: int, world: int) -> list[float] | None:
    """Train the job ``argv`` (trainer flags; its ``--pipeline-schedule`` is replaced by
    ``torch-csv:csv_path``) for ``--train-iters`` iterations with torch's
    ``_PipelineScheduleRuntime`` running ``csv_path``; call on every rank of an initialised
    default process group of ``world`` ranks. Returns the per-iteration loss (the
    mean over the iteration's micro-batches, summed in fp32 as our log's ``loss``) on the rank that holds the
    last part, None elsewhere."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from megatron.trainer.plan.parse import parse_run_plan
    from megatron.trainer.loop.ranks import _init_megatron_parallel_state
    from megatron.trainer.tasks.gpt import GPTTask

    argv = list(argv)
    if "--pipeline-schedule" in argv:
        i = argv.index("--pipeline-schedule")
        del argv[i:i + 2]
    config = parse_run_plan([*argv, "--pipeline-schedule", f"torch-csv:{csv_path}", "--data-parallel-size", "1"])
    _init_megatron_parallel_state()
    cpu = torch.device("cpu")
    layout = config.run.layout
    if layout.num_stages != world:
        raise ValueError(f"{csv_path}: {layout.num_stages} ranks in the CSV, {world} in the process group")
    task = GPTTask()
    chunks = task.build_stage(config, rank, cpu)
    parts = [layout.virtual(rank, c) for c in range(layout.num_chunks)]
    num_parts = layout.num_model_stages
    batch_fn = task.batch_fn(config, 0, cpu)
    m = config.num_microbatches
    model = config.model
    mbs = config.training.micro_batch_size
    current: dict[int, Any] = {}

    class Part(torch.nn.Module):
        """Our chunk behind torch's tensor-in / tensor-out interface; the micro-batch's batch
        dict (tokens, positions, labels) is looked up by the index the stage runs."""

        def __init__(self, chunk: torch.nn.Module, first: bool) -> None:
            super().__init__()
            self.chunk, self.first, self.microbatch = chunk, first, -1

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.chunk(None if self.first else x, current[self.microbatch])

    class Stage(pipelining.PipelineStage):
        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self.submod.microbatch = fwd_chunk_id
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    hidden = torch.empty(model.seq_length, mbs, model.hidden_size, requires_grad=True)
    wrapped = [Part(chunk, part == 0) for chunk, part in zip(chunks, parts)]
    stages = [Stage(w, part, num_parts, cpu,
                    input_args=torch.zeros(mbs, model.seq_length, dtype=torch.long) if part == 0 else hidden,
                    output_args=torch.empty(mbs, model.seq_length) if part == num_parts - 1 else hidden)
              for w, part in zip(wrapped, parts)]

    def loss_fn(output: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # Megatron's per-micro-batch loss
        return (output.float() * mask).sum() / max(int(mask.sum().item()), 1)

    runtime = _PipelineScheduleRuntime(stages, n_microbatches=m, loss_fn=loss_fn)
    runtime._load_csv(csv_path)
    params = [p for chunk in chunks for p in chunk.parameters()]
    o = config.optimizer
    if (o.weight_decay, o.clip_grad, o.lr_warmup_iters, o.lr_decay_style) != (0.0, 0.0, 0, "constant"):
        raise ValueError(f"the job must run AdamW without weight decay, clipping or lr schedule ({COMPARABLE_FLAGS})")
    opt = torch.optim.AdamW(params, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, weight_decay=0.0,
                            foreach=False)
    holds_first, holds_last = 0 in parts, num_parts - 1 in parts
    out: list[float] = []
    for it in range(config.training.train_iters):
        current.clear()
        current.update({i: batch_fn(it * m + i) for i in range(m)})
        tokens = torch.cat([current[i]["tokens"] for i in range(m)]) if holds_first else None
        mask = torch.cat([current[i]["loss_mask"].float() for i in range(m)]) if holds_last else None
        losses: list[torch.Tensor] = []
        opt.zero_grad(set_to_none=True)
        runtime.step(*(() if tokens is None else (tokens,)), target=mask, losses=losses)
        opt.step()
        if holds_last:  # as our stage report: the fp32 sum of the micro-batch losses over their count
            out.append(float(torch.stack([loss.detach() for loss in losses]).sum()) / len(losses))
    return out if holds_last else None

