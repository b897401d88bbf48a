"""The built run configuration, handed from the launcher to its ranks.

The local launcher parses and validates argv once; each rank it starts (forked, or a fresh
``python`` on GPU) reads the result from the file named by :data:`JOB_CONFIG_ENV` instead of
parsing argv again. The file is written by the launcher for its own ranks and removed when
they end. Under torchrun or Slurm there is no launcher of ours: each rank builds the config
from argv itself.
"""
from __future__ import annotations

import argparse
import os
import pickle
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

JOB_CONFIG_ENV = "MEGATRON_ASYNC_JOB_CONFIG"


def write_job_config(args: argparse.Namespace, path: str) -> None:
    with open(path, "wb") as f:
        pickle.dump(args, f, protocol=pickle.HIGHEST_PROTOCOL)


def read_job_config(path: str) -> argparse.Namespace:
    with open(path, "rb") as f:
        args = pickle.load(f)
    if not isinstance(args, argparse.Namespace):
        raise TypeError(f"{JOB_CONFIG_ENV}={path} holds a {type(args).__name__}, not a run configuration")
    return args


def handed_config() -> argparse.Namespace | None:
    """The launcher's configuration in one of its ranks; None elsewhere (parse argv)."""
    path = os.environ.get(JOB_CONFIG_ENV)
    return None if path is None else read_job_config(path)


@contextmanager
def job_config_file(args: argparse.Namespace) -> Iterator[dict[str, str]]:
    """The environment that hands ``args`` to the ranks started inside the block."""
    directory = tempfile.mkdtemp(prefix="megatron-async-job-")
    path = os.path.join(directory, "job_config.pkl")
    try:
        write_job_config(args, path)
        yield {JOB_CONFIG_ENV: path}
    finally:
        shutil.rmtree(directory, ignore_errors=True)
