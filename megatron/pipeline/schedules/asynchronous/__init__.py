"""Asynchronous schedules (stage-local optimizer steps, no flush): PACI, async 1F1B, PipeDream-2BW, PipeMare, AMDP.

The modules are imported by name; this package imports none of them (no import order to keep)."""
