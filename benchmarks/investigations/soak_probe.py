"""In-process memory probe for the soak: samples a process's live heap at update boundaries.

Why not RSS alone: RSS counts pages, not bytes, and a page the allocator touched once stays
resident (glibc gives freed heap memory back only from the top of the heap, or on
``malloc_trim``), so RSS moves in 4 KiB steps whenever a new peak of live buffers is first
reached, however rarely. One such step in the second half of a 2000-iteration run is a slope
of 4 B/iteration: RSS cannot tell that from a leak of 4 B per iteration.

What leaks is *live* memory, and both allocators count it to the byte: glibc's
``mallinfo2()`` (``uordblks``, the in-use bytes of every arena, plus ``hblkhd``, the large
blocks served by mmap: torch tensors, gloo buffers, Python objects over 512 bytes) and
pymalloc's "bytes in allocated blocks" (Python objects up to 512 bytes; its arenas are
mmapped and invisible to mallinfo). Their sum is every byte the process has allocated.

Why glibc's per-thread cache is turned off (``GLIBC_TUNABLES=glibc.malloc.tcache_count=0``,
set by re-executing the probe unless ``--keep-tcache``): each thread keeps up to 7 freed
chunks of each of the 64 small size classes (up to 1032 bytes) in its *tcache*, and
``mallinfo2`` counts those chunks as in use (they stay marked allocated; only the arenas'
bins and fastbins count as free). The caches fill slowly -- a size class a thread frees more often than it allocates
(a chunk another thread allocated, say) gains a chunk now and then, up to 7 x (32 + ... +
1040) = 240 KB per thread -- which read
as a growth decaying from 18 to 0.3 B/iteration over the first 24k iterations of a 2-stage 1F1B rank
(docs/benchmarks_history.md). With the cache off, a freed chunk goes to a bin and leaves ``uordblks``
at once: what remains is what the program holds.

Why a full ``gc.collect()`` before each sample: CPython keeps freed tuples, lists, dicts and
floats on free lists (up to 2000 tuples per size) and frees cyclic garbage only when a
collection runs. Both are bounded but fill slowly -- the 1-, 3- and 9-tuple free lists of a
2-stage PACI rank gain about two tuples per iteration each (``tuple(generator)`` allocates
one size and shrinks it to another) until they reach 2000, some 1000 iterations in, and
rarely used sizes keep filling long after. A full collection empties the free lists and
frees the garbage, so what is left is what the program still references. A real leak (an
object, a tensor or a C++ buffer kept per iteration) survives it.

Why at update boundaries: within an iteration the live set swings by megabytes
(activations, gradients, received buffers); at the same point of every update it is the same.
The probe wraps ``StageWorker.record_update`` (called once per optimizer update on every
stage, in the emulator and in each distributed rank, which are forked from the launcher after
the patch) and samples every ``--every`` updates, at the first stage of the process to reach it.

Usage (``benchmarks/investigations/soak.py`` drives this)::

    python benchmarks/investigations/soak_probe.py --out DIR [--every 10] [--trim] [--leak-bytes 64] \\
        -- pretrain_gpt.py --pipeline-model-parallel-size 2 ...

Each process appends to ``DIR/probe-<pid>.tsv`` a ``#name`` and a ``#glibc_tunables`` line
(what its allocator ran with) and then one line per sample
(:data:`COLUMNS`). ``--trim`` calls ``malloc_trim(0)`` before each sample, so the RSS columns
show what stays resident once free heap pages are returned. ``--leak-bytes N`` keeps one
``bytes(N)`` object every ``--leak-every`` updates for ever: a deliberate leak, used only to
show that the metric catches one (``tests/test_memory_flat.py``, ``soak.py --leak-bytes``).

Attributing growth to Python code: ``--trace-from U --snapshots A B`` starts ``tracemalloc``
at update U and dumps a snapshot at updates A and B (after the sample's collection);
``python benchmarks/investigations/soak_probe.py --compare SNAP_A SNAP_B`` prints what was allocated and is
still held, grouped by traceback. C++ allocations (torch, gloo) are not traced: growth of the
``heap_c`` column with nothing in the comparison is the C/C++ side. While tracing, ``heap_py``
reads 0 (CPython prints no pymalloc statistics once tracemalloc hooks the allocator).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import runpy
import sys
import threading
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
#: one line per sample; every column is exact to the byte except the two RSS ones (pages)
COLUMNS = ("update", "rss", "rss_file", "heap_c", "heap_py", "gc_objects", "threads")


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33+): every field a ``size_t``."""

    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2
_libc.malloc_trim.argtypes = [ctypes.c_size_t]

#: glibc tunable that turns the per-thread cache off (read once, when the process starts)
NO_TCACHE = "glibc.malloc.tcache_count=0"


def tcache_off_env(env: dict[str, str]) -> dict[str, str] | None:
    """``env`` with the thread cache turned off (added to any other tunables), or None when
    ``env`` turns it off already."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if NO_TCACHE in tunables.split(":"):
        return None
    return {**env, "GLIBC_TUNABLES": f"{tunables}:{NO_TCACHE}" if tunables else NO_TCACHE}


def restart_without_tcache() -> None:
    """Re-execute this script with the thread cache off, unless it is off already (glibc
    reads its tunables once, at start-up; forked children inherit the setting)."""
    env = tcache_off_env(dict(os.environ))
    if env is not None:
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def c_heap_in_use() -> int:
    """Bytes malloc has handed out and not had back, over every arena and mmapped block."""
    info = _libc.mallinfo2()
    return info.uordblks + info.hblkhd


def pymalloc_in_use() -> int:
    """Bytes in pymalloc's allocated blocks (0 under ``PYTHONMALLOC=malloc``, where every
    Python object is in :func:`c_heap_in_use`). CPython reports it only through
    ``sys._debugmallocstats()``, which prints to the C stderr: read back from a memfd."""
    memfd = os.memfd_create("pymalloc-stats")
    saved = os.dup(2)
    try:
        os.dup2(memfd, 2)
        sys._debugmallocstats()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    os.lseek(memfd, 0, os.SEEK_SET)
    with os.fdopen(memfd, "rb") as f:
        for line in f:
            if line.startswith(b"# bytes in allocated blocks"):
                return int(line.split(b"=")[1].replace(b",", b""))
    return 0


def rss() -> tuple[int, int]:
    """(resident bytes, of which file-backed or shared), from this process's ``statm``."""
    with open("/proc/self/statm", "rb") as f:
        fields = f.read().split()
    return int(fields[1]) * PAGE, int(fields[2]) * PAGE


@dataclass
class Probe:
    """Samples this process every ``every`` updates; one file per process (forks included)."""

    out: Path
    every: int = 10
    collect: bool = True
    trim: bool = False
    leak_bytes: int = 0
    leak_every: int = 1
    leaked: list[bytes] = field(default_factory=list)  # the deliberate leak: never emptied
    #: ``tracemalloc`` is started at update ``trace_from`` (with ``trace_frames`` frames per
    #: allocation) and a snapshot is dumped at each update of ``snapshots``, after the sample's
    #: collection, to ``DIR/tracemalloc-<pid>-<update>.snap`` (see :func:`compare_snapshots`)
    trace_from: int = -1
    trace_frames: int = 25
    snapshots: tuple[int, ...] = ()
    _pid: int = -1
    _fd: int = -1
    _last_update: int = -1

    def _file(self) -> int:
        if self._pid != os.getpid():  # first update in this process (a forked rank starts afresh)
            self._pid, self._last_update = os.getpid(), -1
            self._fd = os.open(self.out / f"probe-{self._pid}.tsv", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            with open("/proc/self/comm") as f:
                os.write(self._fd, f"#name\t{f.read().strip()}\n".encode())
            os.write(self._fd, f"#glibc_tunables\t{os.environ.get('GLIBC_TUNABLES', '')}\n".encode())
        return self._fd

    def update(self, update: int) -> None:
        """Called by every stage after each update; acts once per update number."""
        fd = self._file()
        if update <= self._last_update:  # another stage of the same process (the emulator)
            return
        self._last_update = update
        if self.leak_bytes and update % self.leak_every == 0:
            self.leaked.append(bytes(self.leak_bytes))
        if update == self.trace_from:
            tracemalloc.start(self.trace_frames)
        if update % self.every == 0 or update in self.snapshots:
            os.write(fd, ("\t".join(map(str, self.sample(update))) + "\n").encode())
        if update in self.snapshots and tracemalloc.is_tracing():
            tracemalloc.take_snapshot().dump(str(self.out / f"tracemalloc-{self._pid}-{update}.snap"))

    def sample(self, update: int) -> tuple[int, ...]:
        if self.collect:
            gc.collect()  # frees cyclic garbage and empties the free lists (a full collection does)
            if not gc.get_freeze_count():
                # what lives now (the model, torch's and megatron's modules) is set aside, so the
                # full collections before later samples traverse only what was created since:
                # ms instead of a second for ~400k objects on a loaded host
                gc.freeze()
        if self.trim:
            _libc.malloc_trim(0)
        resident, file_backed = rss()
        objects = len(gc.get_objects()) + gc.get_freeze_count()
        return (update, resident, file_backed, c_heap_in_use(), pymalloc_in_use(), objects, threading.active_count())


def probed(record_update: Callable[..., None], probe: Probe) -> Callable[..., None]:
    """``StageWorker.record_update`` followed by ``probe.update``."""

    def record_and_probe(self: object, update: int, total_sq: float, lr: float | None) -> None:
        record_update(self, update, total_sq, lr)
        probe.update(update)

    return record_and_probe


def install(probe: Probe) -> None:
    """Probe after every ``StageWorker.record_update`` (patched before any rank is forked)."""
    from megatron.pipeline.runtime.worker import StageWorker

    StageWorker.record_update = probed(StageWorker.record_update, probe)  # type: ignore[method-assign]


@dataclass
class Series:
    """One process's samples: its name, its ``GLIBC_TUNABLES`` and rows of :data:`COLUMNS`."""

    name: str
    rows: list[tuple[int, ...]]
    tunables: str = ""

    @property
    def tcache_off(self) -> bool:
        """Whether glibc's thread cache was off (freed chunks not counted as live)."""
        return NO_TCACHE in self.tunables.split(":")

    def column(self, name: str) -> list[tuple[int, int]]:
        """``(update, value)`` pairs of one column; ``live`` is ``heap_c + heap_py``."""
        if name == "live":
            c, py = COLUMNS.index("heap_c"), COLUMNS.index("heap_py")
            return [(r[0], r[c] + r[py]) for r in self.rows]
        i = COLUMNS.index(name)
        return [(r[0], r[i]) for r in self.rows]


def read(out: Path) -> list[Series]:
    """Every process's samples written to ``out``, ordered by process name."""
    series = []
    for path in out.glob("probe-*.tsv"):
        name, rows, tunables = path.stem, [], ""
        for line in path.read_text().splitlines():
            if line.startswith("#name\t"):
                name = line.split("\t", 1)[1]
            elif line.startswith("#glibc_tunables\t"):
                tunables = line.split("\t", 1)[1]
            elif line:
                rows.append(tuple(int(v) for v in line.split("\t")))
        series.append(Series(name, rows, tunables))
    return sorted(series, key=lambda s: s.name)


def compare_snapshots(old: Path, new: Path, limit: int = 15, frames: int = 12) -> str:
    """What was allocated after ``old`` was taken and is still alive at ``new``, grouped by
    allocation traceback, largest first (blocks freed and re-allocated in between cancel out)."""
    before, after = tracemalloc.Snapshot.load(str(old)), tracemalloc.Snapshot.load(str(new))
    diffs = [d for d in after.compare_to(before, "traceback") if d.size_diff > 0]
    total = sum(d.size_diff for d in diffs)
    lines = [f"{new.name} - {old.name}: +{total} B in {sum(d.count_diff for d in diffs)} blocks"]
    for d in diffs[:limit]:
        lines.append(f"+{d.size_diff} B, +{d.count_diff} blocks (now {d.size} B in {d.count})")
        lines.extend(f"    {line}" for line in d.traceback.format(limit=frames, most_recent_first=True))
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["--compare"]:
        print(compare_snapshots(Path(sys.argv[2]), Path(sys.argv[3]), *map(int, sys.argv[4:6])))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="directory for the probe-<pid>.tsv files")
    p.add_argument("--every", type=int, default=10, help="sample every N updates")
    p.add_argument("--no-collect", dest="collect", action="store_false",
                   help="sample without a full gc.collect() first (free lists and garbage count as live)")
    p.add_argument("--trim", action="store_true", help="malloc_trim(0) before each sample")
    p.add_argument("--leak-bytes", type=int, default=0, help="deliberate leak: keep bytes(N) ...")
    p.add_argument("--leak-every", type=int, default=1, help="... every N updates")
    p.add_argument("--keep-tcache", action="store_true",
                   help="leave glibc's per-thread cache on (its freed chunks then count as live heap)")
    p.add_argument("--trace-from", type=int, default=-1, help="start tracemalloc at this update ...")
    p.add_argument("--trace-frames", type=int, default=25, help="... keeping N frames per allocation")
    p.add_argument("--snapshots", type=int, nargs="*", default=[],
                   help="dump a tracemalloc snapshot at these updates (compare: --compare OLD NEW)")
    p.add_argument("script", help="the training script; its arguments follow (after --)")
    p.add_argument("args", nargs=argparse.REMAINDER)
    ns = p.parse_args()
    if not ns.keep_tcache:
        restart_without_tcache()
    ns.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for `megatron`
    install(Probe(ns.out, ns.every, ns.collect, ns.trim, ns.leak_bytes, ns.leak_every,
                  trace_from=ns.trace_from, trace_frames=ns.trace_frames, snapshots=tuple(ns.snapshots)))
    sys.argv = [ns.script, *ns.args]
    runpy.run_path(ns.script, run_name="__main__")


if __name__ == "__main__":
    main()
