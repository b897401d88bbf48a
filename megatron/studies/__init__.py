"""Convergence studies: grids of emulator runs (schedule x depth x optimizer) and their metrics.

``tools/convergence_study.py`` is the command line; ``docs/convergence.md`` records the results.
"""
