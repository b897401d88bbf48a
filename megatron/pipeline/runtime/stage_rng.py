"""A stage's dropout random stream.

Stage ``s`` starts from ``seed + 100 * s`` (Megatron's convention). The distributed runtime
has one stage per process and seeds the process's generators; the emulator runs every stage
in one process, so each stage keeps its own CPU generator state and swaps it in around its
ops (:meth:`StageRNG.scope`). :meth:`StageRNG.state` has the same form in both, so either
can resume the other's checkpoint.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class StageRNG:
    """The random state a stage's ops draw from (dropout)."""

    def __init__(self, seed: int, device: torch.device, isolate: bool):
        self.device = device
        self.isolate = isolate
        self._cpu = torch.Generator().manual_seed(seed).get_state()
        if not isolate:
            torch.manual_seed(seed)

    def scope(self) -> contextlib.AbstractContextManager[None]:
        """This stage's RNG inside the block (the emulator's stages share one process)."""
        return self._isolated() if self.isolate else contextlib.nullcontext()

    @contextlib.contextmanager
    def _isolated(self) -> Iterator[None]:
        outer = torch.get_rng_state()
        torch.set_rng_state(self._cpu)
        try:
            yield
        finally:
            self._cpu = torch.get_rng_state()
            torch.set_rng_state(outer)

    def state(self) -> dict[str, Any]:
        """The state to rewind to (post-validation's rerun) or to save (checkpoints)."""
        if self.isolate:
            return {"cpu": self._cpu.clone()}
        state: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        from megatron.core import tensor_parallel

        tracker = tensor_parallel.get_cuda_rng_tracker()  # also on CPU under --sequence-parallel
        if tracker.is_initialized():
            state["tracker"] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                for k, v in tracker.get_states().items()}
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        if self.isolate:
            self._cpu = state["cpu"].clone()
            return
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)
        if "tracker" in state:
            from megatron.core import tensor_parallel

            tracker = tensor_parallel.get_cuda_rng_tracker()
            tracker.set_states({k: v.clone() if isinstance(v, torch.Tensor) else v
                                for k, v in state["tracker"].items()})
