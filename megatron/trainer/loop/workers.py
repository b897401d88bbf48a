"""A stage's worker from the run's config: model chunks, optimizer, LR schedule, data, loss
scaling; and what is read off the workers at the end (parameter counts, dumps, drift)."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megatron.pipeline.ir import MultiPipelineLayout
from megatron.pipeline.runtime.gradient_sync import GradientSync
from megatron.pipeline.runtime.loss_scaling import StageLossScaler
from megatron.pipeline.runtime.parallel import DataParallelGroup
from megatron.pipeline.runtime.replicas import optimizer_shards
from megatron.pipeline.runtime.tied_embeddings import counted
from megatron.pipeline.runtime.transport import Transport
from megatron.pipeline.runtime.weight_versions import build_weight_policy
from megatron.pipeline.runtime.worker import StageSetup, StageWorker
from megatron.trainer.config.ddp_args import overlap_bucket_size
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.config.mixed_precision_args import loss_scale_config
from megatron.trainer.models.tensor_parallel import build_tensor_parallel_stage, full_shape, gather_full, shard_layout
from megatron.trainer.optim.data_parallel import shard_over_data_parallel
from megatron.trainer.optim.lr_schedule import LRSchedule
from megatron.trainer.optim.registry import build_optimizer
from megatron.trainer.tasks.task import PretrainTask


def build_worker(task: PretrainTask, config: RunPlan, stage: int, dp_rank: int,
                 device: torch.device, isolate_rng: bool,
                 data_parallel: DataParallelGroup | None = None) -> StageWorker:
    """Stage ``stage``'s worker; ``data_parallel``: its replicas' group, which its gradients are
    averaged over (None: one replica, all stages in this process)."""
    training, logging = config.training, config.logging
    chunks = build_tensor_parallel_stage(task, config, stage, device)
    run = config.run
    layout = run.layout
    if len(chunks) != layout.num_chunks:
        raise ValueError(f"task {task.name} built {len(chunks)} model chunks for stage {stage}, "
                         f"the pipeline layout has {layout.num_chunks}")
    named = list(task.named_parameters(chunks))
    shards = None
    if run.shards_optimizer_state:
        assert isinstance(layout, MultiPipelineLayout)
        shards = optimizer_shards(layout, chunks, named)
    optimizer = shard_over_data_parallel(config, named, stage, dp_rank) or build_optimizer(config, named, stage, shards)
    schedule = LRSchedule(
        max_lr=config.optimizer.lr, min_lr=config.optimizer.min_lr, warmup_steps=config.optimizer.lr_warmup_iters,
        decay_steps=config.optimizer.lr_decay_iters, decay_style=config.optimizer.lr_decay_style,
        wsd_decay_steps=config.optimizer.lr_wsd_decay_iters or 0, wsd_decay_style=config.optimizer.lr_wsd_decay_style,
    )
    shape, dtype = task.activation_spec(config)
    # Asynchronous variants shape what a stage's passes read and its learning rate (2BW, PipeMare).
    policy = run.schedule_cls.traits.policy_for(run.schedule)
    setup = StageSetup(
        stage=stage,
        layout=layout,
        chunks=chunks,
        optimizer=optimizer,
        lr_schedule=policy.lr_schedule(stage, schedule),
        microbatches_per_update=config.num_microbatches,
        batch_fn=task.batch_fn(config, dp_rank, device),
        loss_fn=task.loss_fn,
        activation_shape=shape,
        activation_dtype=dtype,
        device=device,
        clip_grad=config.optimizer.clip_grad,
        seed=training.seed,
        inject_nonfinite_updates=frozenset(logging.nonfinite_injections.get(stage, ())),
        inject_nonfinite_losses=frozenset(logging.inject_nonfinite_loss),
        weight_policy=build_weight_policy(policy.weight_policies[stage], optimizer),
        loss_scaler=_loss_scaler(config, run.asynchronous),
        report_params_norm=logging.log_params_norm,
        measure_activations=logging.log_activation_memory,
        aux_loss_fn=task.aux_loss_fn if task.aux_loss_name else None,
        tp_group=_tensor_parallel_group(run.tensor_parallel_size),
    )
    grad_sync = None if data_parallel is None else GradientSync(setup, data_parallel, overlap_bucket_size(config))
    return StageWorker(setup, isolate_rng=isolate_rng, grad_sync=grad_sync)


def _tensor_parallel_group(tp_size: int) -> dist.ProcessGroup | None:
    """megatron's TP group of this rank (set by :func:`initialize_tensor_parallel`); None at TP = 1."""
    if tp_size == 1:
        return None
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _loss_scaler(config: RunPlan, asynchronous: bool) -> StageLossScaler | None:
    """``--fp16``: the stage's scaler, pipeline-wide for synchronous schedules, stage-local otherwise."""
    scaling = loss_scale_config(config, asynchronous)
    return None if scaling is None else StageLossScaler(scaling)


def stage_parameter_count(worker: StageWorker, tp_size: int = 1) -> int:
    """Parameters of one stage (all its model chunks), for the start banner: of the whole
    stage, a TP shard counted at its full (unsharded) size."""
    return sum(full_shape(p.shape, shard_layout(p), tp_size).numel()
               for p in counted(p for chunk in worker.setup.chunks for p in chunk.parameters()))  # a tied embedding once


def dump_parameters(task: PretrainTask, worker: StageWorker, directory: str, tp_rank: int = 0) -> None:
    """``--dump-final-params``: the stage's full parameters (TP shards gathered: a collective
    over the TP group), written by TP rank 0."""
    group = worker.setup.tp_group
    state = {name: gather_full(p.detach(), shard_layout(p), group).cpu().clone()
             for name, p in task.named_parameters(worker.setup.chunks)}
    if tp_rank:
        return
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    torch.save(state, path / f"stage{worker.stage}.pt")


def print_drift_histograms(workers: list[StageWorker]) -> None:
    for w in workers:
        hist = ", ".join(f"{d}: {n}" for d, n in sorted(w.drift_histogram.items()))
        print(f" weight-version drift histogram, stage {w.stage}: {{{hist}}}", flush=True)


def local_workers(task: PretrainTask, config: RunPlan, transport: Transport, device: torch.device) -> list[StageWorker]:
    """The transport's local stage workers, each with its gradient sync over the replicas the
    transport describes (the distributed optimizer's group, overlapped gradient buckets)."""
    return [build_worker(task, config, s, transport.dp_rank, device, isolate_rng=transport.in_process,
                         data_parallel=transport.data_parallel_group)
            for s in transport.stages]
