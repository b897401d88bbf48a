"""What checkpointing needs of a task: its model's name and its parameters' global names.

Checkpoints sit below tasks (a task's model is saved, the saver knows no task), so they ask
for this narrow contract; every :class:`~megatron.trainer.tasks.task.PretrainTask` has it.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch


class NamedModel(Protocol):
    """A model family as the checkpoint sees it."""

    #: recorded in the checkpoint; a resume of another model family is refused
    name: str

    def named_parameters(self, chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Parameters by name in the unsplit model, so any split saves and loads the same keys."""
        ...
