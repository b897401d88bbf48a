"""The V placement (two chunks per stage) and its schedules: ZB-V, V-Half, V-Min, DualPipeV.

The modules are imported by name; this package imports none of them (no import order to keep)."""
