"""Shared pytest fixtures and marker handling."""

from __future__ import annotations

import datetime

import pytest
import torch


@pytest.fixture(scope="session")
def megatron_world1():
    """gloo world of size 1 plus megatron parallel state (TP = PP = 1), once per session.

    Megatron modules look up their (trivial) tensor-parallel group at construction, so any test
    that builds a megatron-core model needs this. Our runtime does the pipelining itself, hence
    megatron's pipeline size stays 1. The timeout keeps a wedged collective from hanging CI. One
    rank needs no port: an in-memory store (a probed free port can be taken by a parallel test
    before the store binds it).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    yield


def pytest_collection_modifyitems(config, items):
    """Skip ``@pytest.mark.gpu`` tests cleanly on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def keep_update_history(monkeypatch):
    """Stage workers keep every update's log entry (by default only the logging interval's)."""
    from megatron.pipeline.runtime.worker import StageWorker

    monkeypatch.setattr(StageWorker, "keep_update_history", True)
    yield
