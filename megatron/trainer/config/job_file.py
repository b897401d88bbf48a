"""The built run configuration, handed from the launcher to its ranks.

The local launcher parses and checks argv once; each rank it starts (forked, or a fresh
``python`` on GPU) reads the result from the file named by :data:`JOB_CONFIG_ENV` instead of
parsing argv again. The file is written by the launcher for its own ranks and removed when
they end. Under torchrun or Slurm there is no launcher of ours: each rank builds the config
from argv itself.
"""
from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from megatron.trainer.config.job_config import JobConfig

JOB_CONFIG_ENV = "MEGATRON_ASYNC_JOB_CONFIG"


def write_job_config(config: JobConfig, path: str) -> None:
    with open(path, "wb") as f:
        pickle.dump(config, f, protocol=pickle.HIGHEST_PROTOCOL)


def read_job_config(path: str) -> JobConfig:
    with open(path, "rb") as f:
        config = pickle.load(f)
    if not isinstance(config, JobConfig):
        raise TypeError(f"{JOB_CONFIG_ENV}={path} holds a {type(config).__name__}, not a job configuration")
    return config


def handed_config() -> JobConfig | None:
    """The launcher's configuration in one of its ranks; None elsewhere (parse argv)."""
    path = os.environ.get(JOB_CONFIG_ENV)
    return None if path is None else read_job_config(path)


@contextmanager
def job_config_file(config: JobConfig) -> Iterator[dict[str, str]]:
    """The environment that hands ``config`` to the ranks started inside the block."""
    directory = tempfile.mkdtemp(prefix="megatron-async-job-")
    path = os.path.join(directory, "job_config.pkl")
    try:
        write_job_config(config, path)
        yield {JOB_CONFIG_ENV: path}
    finally:
        shutil.rmtree(directory, ignore_errors=True)
