"""The training driver: segments, runners, logging, start banner and end summary."""
