"""Zero Bubble (Qi et al.): the handcrafted ZB-H1/H2, the greedy ZB-1p/2p, their profiled wrapper and optimizer post-validation.

The modules are imported by name; this package imports none of them (no import order to keep)."""
