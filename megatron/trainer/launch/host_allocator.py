"""The host allocator policy of a training process: keep freed memory in the heap (glibc).

Why: a CPU training step frees and re-allocates the same tensor sizes on every micro-batch
(activations, MLP intermediates, logits, gradients). glibc hands large blocks back to the
kernel: blocks above its mmap threshold are unmapped when freed, and free space at the top of
the heap beyond its trim threshold is released. Both thresholds adapt, but the trim threshold
stays at twice the mmap threshold, so the heap top is released and faulted back in, one
zero-filled page at a time, iteration after iteration. With both thresholds pinned high, freed
memory stays in the heap and a re-allocation is a free-list hit.

Measured on the issue-18 workload (2 CPU ranks, docs/benchmarks.md): a third fewer minor page
faults per run and 2-3 % more tokens/s, at the same peak RSS. The price is RSS that stays at
its peak instead of shrinking between iterations. GPU ranks allocate little on the host, so the
policy changes nothing there. It needs glibc's ``mallopt``; elsewhere (macOS, musl) it is a
no-op, reported as such by :func:`apply_host_malloc`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Literal

HostMalloc = Literal["retain", "system"]
HOST_MALLOC_CHOICES: tuple[HostMalloc, ...] = ("retain", "system")

# glibc's <malloc.h> parameter numbers
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# mallopt takes an int: the largest threshold it can express (2 GiB - 1). Blocks above it
# (rare on a host) are still mmap'd and returned on free.
_RETAIN_THRESHOLD = 2**31 - 1


def _mallopt() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """glibc's ``mallopt``, or None where the C library has none (or is not glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        gnu_version = libc.gnu_get_libc_version  # only glibc has it: musl's mallopt is a stub
    except (OSError, AttributeError):
        return None
    del gnu_version
    return getattr(libc, "mallopt", None)


def apply_host_malloc(policy: HostMalloc) -> str:
    """Apply ``policy`` to this process's C allocator; return what took effect, for the log.

    ``retain`` pins glibc's mmap and trim thresholds at their maximum (which also switches off
    their adaptation); ``system`` leaves the C library's defaults. Called in each rank (and the
    emulator) before its model is built, so every training allocation follows the policy.
    """
    if policy == "system":
        return "system (the C library's defaults)"
    mallopt = _mallopt()
    if mallopt is None:
        return "system (retain needs glibc's mallopt; not available here)"
    ok = mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(_RETAIN_THRESHOLD)) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(_RETAIN_THRESHOLD)) == 1 and ok
    if not ok:
        return "system (glibc refused the thresholds)"
    return "retain (glibc keeps freed memory in the heap)"
