"""The file format of per-stage op traces (``--trace-dir DIR``), shared by writer and reader.

Why apart from the writer: :mod:`megatron.pipeline.runtime.tracing` records traces during a
run and needs torch (it synchronises CUDA around traced ops); :mod:`megatron.pipeline.trace_analysis`
and ``tools/merge_traces.py`` read them on any machine, torch or not. Both name the files and
check the format through this module, so they cannot drift apart.

File ``DIR/stage{S}_dp{D}.json`` (written at the end of every training segment, cumulative)::

    {"format": "megatron-async-trace", "version": 1, "stage": S, "dp_rank": D, "host": ...,
     "executor": "distributed" | "emulator", "schedule": "1f1b", "num_stages": N,
     "num_chunks": C, "layout": "PipelineLayout", "microbatches_per_update": a,
     "clock": "time_ns", "align_ns": [...],
     "ops": [[kind, mb, chunk, update, sync, start_ns, end_ns], ...]}

``kind`` is the op kind's value (:class:`megatron.pipeline.ir.OpKind`), timestamps are
``time.time_ns()``, and ``align_ns`` lists instants taken right after a barrier every rank
passed (a common reference for ranks on different hosts).
"""
from __future__ import annotations

#: The ``"format"`` field of every trace file
TRACE_FORMAT = "megatron-async-trace"
#: The ``"version"`` field; bump it when a field changes meaning
TRACE_VERSION = 1
#: The trace files of one directory
TRACE_FILE_GLOB = "stage*_dp*.json"


def trace_file_name(stage: int, dp_rank: int) -> str:
    """The file one stage of one data-parallel replica writes its trace to."""
    return f"stage{stage}_dp{dp_rank}.json"
