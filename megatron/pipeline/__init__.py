"""Pipeline library of Megatron-Async: schedule IR, schedules, schedule check and executors.

A schedule is data: per pipeline stage, an ordered stream of :class:`~megatron.pipeline.ir.Op`.
Three executors consume the same streams: the distributed runtime (one process per stage),
the single-process emulator, and the timing simulator.
"""
