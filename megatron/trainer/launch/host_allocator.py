"""The host allocator policy of a training process: keep freed memory in the heap (glibc).

Why: a CPU training step frees and re-allocates the same tensor sizes on every micro-batch
(activations, MLP intermediates, logits, gradients). glibc hands large blocks back to the
kernel: blocks above its mmap threshold are unmapped when freed, and free space at the top of
the heap beyond its trim threshold is released. Both thresholds adapt, but the trim threshold
stays at twice the mmap threshold, so the heap top is released and faulted back in, one
zero-filled page at a time, iteration after iteration. With both thresholds pinned high, freed
memory stays in the heap and a re-allocation is a free-list hit.

Measured on the issue-18 workload (2 CPU ranks, docs/benchmarks_history.md): a third fewer minor page
faults per run and 1-2.5 % more tokens/s, at the same peak RSS (also after 60 iterations). The
price is RSS that stays at its peak instead of shrinking between iterations. GPU ranks allocate little on the host, so the
policy changes nothing there. It needs glibc's ``mallopt``; elsewhere (macOS, musl) it is a
no-op, reported as such by :func:`apply_host_malloc`.
"""
from __future__ import annotations

import ctypes
import ctypes.util

from megatron.trainer.config.choices import HostMalloc


# glibc's <malloc.h> parameter numbers
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to 64 MiB come from the heap (glibc's own adaptive ceiling is 32 MiB); larger ones
# are still mmap'd and returned on free. Why a ceiling: torch allocates with posix_memalign, and
# a freed block that the next equal request cannot reuse (its alignment slack does not fit)
# stays free in the heap; a loop over one huge transient tensor can hold several copies of it
# (docs/benchmarks_history.md). Heap top: never trimmed (the largest value mallopt takes, an int).
_RETAIN_MMAP_THRESHOLD = 64 << 20
_RETAIN_TRIM_THRESHOLD = 2**31 - 1


def _mallopt() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """glibc's ``mallopt``, or None where the C library has none (or is not glibc)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version"):  # only glibc has it: musl's mallopt is a stub
        return None
    return getattr(libc, "mallopt", None)


def apply_host_malloc(policy: HostMalloc) -> str:
    """Apply ``policy`` to this process's C allocator; return what took effect, for the log.

    ``retain`` pins glibc's mmap threshold at 64 MiB and its trim threshold at its maximum
    (which also switches off their adaptation); ``system`` leaves the C library's defaults. Called in each rank (and the
    emulator) before its model is built, so every training allocation follows the policy.
    """
    if policy == "system":
        return "system (the C library's defaults)"
    mallopt = _mallopt()
    if mallopt is None:
        return "system (retain needs glibc's mallopt; not available here)"
    ok = mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(_RETAIN_MMAP_THRESHOLD)) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(_RETAIN_TRIM_THRESHOLD)) == 1 and ok
    if not ok:
        return "system (glibc refused the thresholds)"
    return "retain (glibc keeps freed memory in the heap)"
