"""What Python's cyclic garbage collector does while a run trains (``--manual-gc`` and friends).

Why it matters: a rank holds ~0.5 M Python objects after importing torch and megatron-core
and building its stage, and a full (generation 2) collection walks all of them: 200-250 ms
on the CPU ranks here, a stall that lands in whichever op allocates the triggering object and
holds up every stage waiting on it. Two measures, Megatron-LM's and one of ours:

* **In every rank process of the runtime:** at the start of training everything alive is
  collected once and then *frozen* (``gc.freeze``): start-up objects move to a permanent
  generation that later collections do not walk, so the one full collection a rank used to run
  early in training happens before the first op, and any later one walks only what training
  created. Unfrozen again when training ends. Not in the emulator: it runs inside processes
  that hold far more than a run's objects and train many times (a test session paid 0.2 s per
  run, 33 s in 162 runs), and a stall there delays no other process.
* **``--manual-gc``** (Megatron-LM's flag): automatic collection is off during training;
  ``--manual-gc-interval N`` collects every N updates, so the ranks collect at the same update
  instead of each at its own moment (0: never between updates), and, unless
  ``--no-manual-gc-eval``, around each evaluation.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from megatron.trainer.config.run_plan import RunPlan


class CollectorPolicy:
    """The run's garbage-collection policy (see the module docstring)."""

    def __init__(self, manual: bool = False, interval: int = 0, around_evaluation: bool = True,
                 freeze_startup: bool = True):
        if interval < 0:
            raise ValueError(f"manual garbage collection interval must be >= 0, got {interval}")
        self.manual = manual
        self.interval = interval
        self.around_evaluation = around_evaluation
        self.freeze_startup = freeze_startup
        self._last_collected_update = -1
        self.collections = 0  # manual collections during training (start-up and evaluation included)

    @classmethod
    def from_args(cls, config: RunPlan, freeze_startup: bool) -> CollectorPolicy:
        return cls(bool(config.launch.manual_gc), int(config.launch.manual_gc_interval or 0),
                   bool(config.launch.manual_gc_eval), freeze_startup)

    def _collect(self) -> None:
        gc.collect()
        self.collections += 1

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Collect and freeze the start-up objects (with ``freeze_startup``) and stop automatic
        collection (under ``--manual-gc``, after collecting once) for the body; restore the
        collector's state afterwards."""
        was_enabled = gc.isenabled()
        if self.freeze_startup or self.manual:
            self._collect()
        if self.freeze_startup:
            gc.freeze()
        if self.manual:
            gc.disable()
        try:
            yield
        finally:
            if self.freeze_startup:
                gc.unfreeze()
            if was_enabled:
                gc.enable()

    def after_update(self, update: int) -> None:
        """Called after every local stage's update ``update`` (0-based); collects once per due
        update, however many stages this process holds."""
        if not (self.manual and self.interval) or update <= self._last_collected_update:
            return
        if (update + 1) % self.interval == 0:
            self._last_collected_update = update
            self._collect()

    def evaluation_boundary(self) -> None:
        """Called before and after each evaluation."""
        if self.manual and self.around_evaluation:
            self._collect()
