"""This process's host and device: CUDA or CPU, cores, threads and the host allocator."""
from __future__ import annotations

import argparse
import os

import torch

from megatron.trainer.launch.core_binding import bind_cores
from megatron.trainer.launch.host_allocator import apply_host_malloc


def uses_cuda(args: argparse.Namespace) -> bool:
    return args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())


def resolve_device(args: argparse.Namespace, local_rank: int) -> torch.device:
    if uses_cuda(args):
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def prepare_host(args: argparse.Namespace, local_processes: int, local_rank: int = 0) -> None:
    """This process's cores, CPU threads and host allocator policy, before any model is built
    (and before any thread starts: threads inherit the core binding)."""
    args.core_binding_effect = bind_cores(args.bind_cores, not uses_cuda(args), local_rank, local_processes)
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // max(1, local_processes))
    torch.set_num_threads(threads)
    args.host_malloc_effect = apply_host_malloc(args.host_malloc)  # shown in the banner


def runs_on_cpu(args: argparse.Namespace) -> bool:
    """Whether this run will use the CPU, asked without creating a CUDA context (fork-safe)."""
    if args.device != "auto":
        return args.device == "cpu"
    previous = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # NVML query: does not initialise CUDA
    try:
        return not torch.cuda.is_available()
    finally:
        if previous is None:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = previous
