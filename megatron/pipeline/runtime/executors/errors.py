"""The distributed runtime's one error type, in a module of its own so that every part of the
runtime (the executor, the send reaper, the statistics side channel) can raise it."""
from __future__ import annotations


class PipelineRuntimeError(RuntimeError):
    """A failure in the pipeline runtime; the message names the stage, rank and op."""
