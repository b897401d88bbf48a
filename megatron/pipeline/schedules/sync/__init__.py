"""Synchronous schedules over a chain or interleaved layout: GPipe, 1F1B with a flush, interleaved 1F1B.

The modules are imported by name; this package imports none of them (no import order to keep)."""
