"""Checkpoints: per-rank state, paths, atomic publishing."""
