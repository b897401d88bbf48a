"""The pieces of ``benchmarks/gpu_check.py`` (issue 29): one offline command that settles the
CUDA path on one GPU. Each module has one job; the driver strings them together."""
