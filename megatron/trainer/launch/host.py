"""This process's host and device: CUDA or CPU, cores, threads and the host allocator."""
from __future__ import annotations

import dataclasses
import os

import torch

from megatron.trainer.config.run_plan import HostEffects, RunPlan
from megatron.trainer.launch.core_binding import bind_cores
from megatron.trainer.launch.host_allocator import apply_host_malloc


def uses_cuda(config: RunPlan) -> bool:
    return config.launch.device == "cuda" or (config.launch.device == "auto" and torch.cuda.is_available())


def resolve_device(config: RunPlan, local_rank: int) -> torch.device:
    if uses_cuda(config):
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def prepare_host(config: RunPlan, local_processes: int, local_rank: int = 0) -> RunPlan:
    """This process's cores, CPU threads and host allocator policy, before any model is built
    (and before any thread starts: threads inherit the core binding); the config with what
    they did, for the banner."""
    binding = bind_cores(config.launch.bind_cores, not uses_cuda(config), local_rank, local_processes)
    threads = config.launch.num_threads or max(1, (os.cpu_count() or 1) // max(1, local_processes))
    torch.set_num_threads(threads)
    allocator = apply_host_malloc(config.launch.host_malloc)
    return dataclasses.replace(config, host=HostEffects(core_binding=binding, host_malloc=allocator))


def runs_on_cpu(config: RunPlan) -> bool:
    """Whether this run will use the CPU, asked without creating a CUDA context (fork-safe)."""
    if config.launch.device != "auto":
        return config.launch.device == "cpu"
    previous = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # NVML query: does not initialise CUDA
    try:
        return not torch.cuda.is_available()
    finally:
        if previous is None:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = previous
