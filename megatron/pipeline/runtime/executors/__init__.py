"""Executors of op streams: the distributed runtime and the single-process emulator."""
