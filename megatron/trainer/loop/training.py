"""The names scripts and tests have imported from here since before :mod:`.trainer` (where the
trainer now lives, read top to bottom); :func:`drive` trains on a built transport."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist  # noqa: F401  (tests patch its functions through this module)

from megatron.pipeline.runtime.transport import Transport
from megatron.pipeline.runtime.worker import StageWorker
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.launch.exit_control import StopControl
from megatron.trainer.launch.host import prepare_host
from megatron.trainer.loop.ranks import _init_megatron_parallel_state, rank_transport
from megatron.trainer.loop.trainer import Trainer, emulate, preflight, pretrain, run_distributed
from megatron.trainer.loop.workers import build_worker
from megatron.trainer.tasks.task import PretrainTask

__all__ = ["build_worker", "drive", "emulate", "preflight", "prepare_host", "pretrain", "rank_transport",
           "run_distributed", "_init_megatron_parallel_state"]


def drive(task: PretrainTask, config: RunPlan, transport: Transport, device: torch.device,
          stop: StopControl | None,
          make_transport: Callable[[RunPlan], Transport] | None = None) -> list[StageWorker]:
    """Train the transport's local stages (:class:`~.trainer.Trainer`); the local stage workers."""
    return Trainer(task, config, transport, device, stop, make_transport).train()
