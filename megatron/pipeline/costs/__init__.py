"""What ops and stages cost: analytic FLOPs, per-op costs, activation memory, unit costs, the layer partition.

One package imported by the planner, the partitioner and the schedules alike (torch-free).

The modules are imported by name; this package imports none of them (no import order to keep)."""
