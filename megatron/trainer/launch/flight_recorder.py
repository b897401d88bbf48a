"""Keeps torch's c10d flight recorder off unless the user asks for it.

Why: torch records every collective a process group runs (gloo included) in a ring of
``TORCH_FR_BUFFER_SIZE`` entries (2000 by default), each with a captured Python traceback,
about 0.5 KB per entry. The synchronous step's grad-norm all-gather and the statistics
receive add two entries per iteration on the logging rank, so its C heap grew by ~1 MB over
the first ~1000-2000 iterations: the "unexplained" 0.5-0.9 KB/iteration of the soak
benchmark (found with heaptrack). Bounded, but it is debugging state the pipeline does not
need: every wait here has its own timeout and error naming the op. A user who wants the
recorder (e.g. to dump NCCL hangs) sets either variable and keeps it.
"""
from __future__ import annotations

import os

# torch reads the first of these that is set (the second is the older NCCL-only name)
BUFFER_SIZE_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def disable_unless_requested() -> None:
    """Set ``TORCH_FR_BUFFER_SIZE=0`` unless the user set a buffer size; call before the
    first process group is created (torch reads it once, when the recorder is built)."""
    if not any(v in os.environ for v in BUFFER_SIZE_VARS):
        os.environ[BUFFER_SIZE_VARS[0]] = "0"
