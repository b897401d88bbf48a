"""Process management: local launcher, Slurm, signals, orphan protection."""
