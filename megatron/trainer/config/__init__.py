"""Command-line flags, their checks and the run configuration built from them."""
