"""The stage optimizer of ``--use-distributed-optimizer``: built sharded over the data-parallel group.

Why here: the flags decide (``--use-distributed-optimizer``, ``--overlap-param-gather``,
``--data-parallel-size``), the registry builds the optimizer with the replica's shards, and
:class:`~megatron.pipeline.runtime.distributed_optimizer.DataParallelShardedOptimizer` adds the
collectives. With one replica there is nothing to shard: the plain optimizer, and one log line.
"""
from __future__ import annotations


from megatron.pipeline.runtime.distributed_optimizer import DataParallelShardedOptimizer, data_parallel_shards
from megatron.trainer.config.run_plan import RunPlan
from megatron.trainer.optim.registry import NamedParameters, build_optimizer


def shard_over_data_parallel(config: RunPlan, named: NamedParameters, stage: int,
                             dp_rank: int) -> DataParallelShardedOptimizer | None:
    """Stage ``stage``'s optimizer on replica ``dp_rank``, sharded; None without the flag or at DP=1."""
    if not config.parallel.use_distributed_optimizer:
        return None
    dp = config.parallel.data_parallel_size
    if dp == 1:
        if stage == 0:
            print("[megatron-async] --use-distributed-optimizer: one data-parallel replica, nothing to shard "
                  "(no-op)", flush=True)
        return None
    inner = build_optimizer(config, named, stage, data_parallel_shards(named, dp, dp_rank))
    return DataParallelShardedOptimizer(inner, dp_rank, dp, overlap_param_gather=config.parallel.overlap_param_gather)
