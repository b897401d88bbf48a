"""How much an overlapped F&B slot (DualPipeV's) saves in the simulator.

DualPipeV pairs one chunk's forward with the other chunk's fused backward in one slot. How
much of the two runs at the same time depends on the implementation: PyTorch's
``ScheduleDualPipeV`` without a custom overlap function, and our executors, run the forward and
then the backward (nothing overlaps); DeepSeek's DualPipe with its overlapped kernels hides
most of the shorter of the two behind the longer.

The simulator takes an ``overlap`` factor ``a`` in ``[0, 1]``. The backward of an overlapped
slot (its stream puts it right after the slot's forward) may start once its own inputs have
arrived, while the forward still runs: the part of the forward after that arrival is the
window in which the two can share the stage, and ``a`` times the overlappable time
``min(window, forward, backward)`` is taken off the backward. With both inputs there at the
slot's start, the slot lasts ``F + BW - a min(F, BW)``: ``F + BW`` at ``a = 0`` (serial, the
default, what the executors run) and ``max(F, BW)`` at ``a = 1`` (full overlap). A backward
whose input arrives after the forward ended saves nothing: there was nothing to overlap.
"""
from __future__ import annotations

import math


def check_overlap(factor: float) -> float:
    """``factor`` as a float in ``[0, 1]`` (ValueError otherwise)."""
    value = float(factor)
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"overlap factor must be in [0, 1] (0: F then B, 1: full overlap), got {factor!r}")
    return value


def overlap_saving(factor: float, forward_start: float, forward_end: float, backward_ready: float,
                   backward: float) -> float:
    """Time taken off an overlapped slot's backward (duration ``backward``, inputs arrived at
    ``backward_ready``) run after the slot's forward ``[forward_start, forward_end]``."""
    window = forward_end - max(forward_start, backward_ready)
    if factor == 0.0 or window <= 0.0:
        return 0.0
    return factor * min(window, forward_end - forward_start, backward)
