"""The global batch of every iteration (``--rampup-batch-size``): a value, in a module of its own.

Every section of the job config may name it (``TrainingConfig.batch_plan``) without importing
the flag checks that build it (:mod:`megatron.trainer.config.rampup_args`).
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPlan:
    """Global batch per iteration: ``ramp`` for the first iterations, then ``final`` for ever."""

    ramp: tuple[int, ...]
    final: int

    def global_batch(self, iteration: int) -> int:
        return self.ramp[iteration] if iteration < len(self.ramp) else self.final

    def consumed_before(self, iteration: int) -> int:
        """Samples consumed by iterations ``[0, iteration)``."""
        head = sum(self.ramp[:iteration])
        return head + max(0, iteration - len(self.ramp)) * self.final

    def iterations_for(self, samples: int) -> int:
        """Fewest iterations that consume at least ``samples`` samples."""
        cumulative = [0]
        for batch in self.ramp:
            cumulative.append(cumulative[-1] + batch)
        if samples <= cumulative[-1]:
            return bisect_left(cumulative, samples)
        return len(self.ramp) + -(-(samples - cumulative[-1]) // self.final)

    def iterations_in(self, samples: int) -> int:
        """Iterations of a ``--train-samples`` run, as Megatron-LM counts them: the ramp while
        fewer than ``samples`` were consumed, then the whole final batches that fit (a partial
        last batch is dropped)."""
        iterations = consumed = 0
        for batch in self.ramp:
            if consumed > samples:
                break
            consumed += batch
            iterations += 1
        return iterations + max(0, samples - consumed) // self.final

    def changes(self, train_iters: int) -> list[int]:
        """Iterations ``i`` in ``(0, train_iters)`` whose batch differs from iteration ``i - 1``'s."""
        return [i for i in range(1, min(train_iters, len(self.ramp) + 1))
                if self.global_batch(i) != self.global_batch(i - 1)]
