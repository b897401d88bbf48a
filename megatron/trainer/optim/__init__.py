"""Stage-local optimizers (AdamW, basis rotation) and learning-rate schedules."""
