"""PipeDream-2BW (Narayanan et al., ICML 2021): asynchronous 1F1B with double-buffered weights.

The op streams are PACI's (1F1B without flushes, each stage steps after its ``a`` local
backwards, ``a`` = micro-batches per global batch per replica); what differs is which weights
the passes read, decided in the stage worker by
:class:`~megatron.pipeline.runtime.weight_versions.DoubleBufferedWeights`: window ``w``'s micro-batches
run forward and backward on version ``w - 1`` (weight stashing, drift 0), so
``W(t+1) = W(t) - lr * grad f(W(t-1))`` and each stage holds two weight versions, one extra copy.

Why ``a >= N - 1``: stage ``s`` keeps ``N - 1 - s`` forwards in flight, so window ``w``'s
first forward on stage 0 runs ``N - 1`` backwards before the window's last backward. Version
``w - 1`` must still be held then: at most one update (``w - 1``) may fall in between, i.e.
``N - 1 <= a``. (The paper states ``m >= d``; our 1F1B needs one micro-batch less.)

Choice: every window computes on ``w - 1``, also on the last stage, where ``w`` is already
current when the window starts. The paper's steady state ("new inputs use the latest
version") would give the last stage 0-stale gradients and the others mixed ones; fixing the
version per window makes every stage follow the same 1-stale recursion the paper states.
"""
from __future__ import annotations

import dataclasses

from megatron.pipeline.schedules.base import ScheduleConfig, ScheduleConfigError
from megatron.pipeline.schedules.asynchronous.paci import PACI
from megatron.pipeline.schedules.policy import SchedulePolicy
from megatron.pipeline.weight_policy import COUNTED_WEIGHT_VERSIONS, DoubleBuffered


def double_buffered_policy(config: ScheduleConfig) -> SchedulePolicy:
    """Every stage stashes one weight version (two copies) and reads window ``w - 1``'s (so every
    gradient is one update stale); the stash is weight-policy state a checkpoint saves."""
    n = config.num_stages
    return dataclasses.replace(SchedulePolicy.plain(config.layout), weight_copies=(2,) * n,
                               weight_policies=(DoubleBuffered(config.num_microbatches),) * n,
                               stashes_weights=True, weight_policy_has_state=True,
                               fixed_accumulation=COUNTED_WEIGHT_VERSIONS, gradient_delays=(1,) * n)


class PipeDream2BW(PACI):
    name = "pipedream-2bw"
    traits = dataclasses.replace(PACI.traits, policy_for=double_buffered_policy)

    @classmethod
    def check_config(cls, config: ScheduleConfig) -> None:
        super().check_config(config)
        if config.num_microbatches < config.num_stages - 1:
            raise ScheduleConfigError(
                f"pipedream-2bw keeps two weight versions, which needs at least N - 1 = {config.num_stages - 1} "
                f"micro-batches per update (global batch / (micro batch x DP)); got {config.num_microbatches}")
