"""Ranks do not parse argv again: the launcher builds the run plan once and hands it
to every local rank (a file named in the rank's environment), forked or started fresh as on GPU.

A wrapper entry point counts every parser built (``OneLineParser``, the class of the trainer's
parser) by process id; a 2-rank run must build exactly one, in the launcher.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.trainer.config.plan_file import RUN_PLAN_ENV, read_run_plan, run_plan_file
from megatron.trainer.loop.training import preflight
from megatron.trainer.tasks.gpt import GPTTask

REPO = Path(__file__).resolve().parents[1]

WRAPPER = '''
import os, sys
from megatron.trainer.config import flag_checks
from megatron.trainer import environment
from megatron.trainer.launch import launcher

_init = flag_checks.OneLineParser.__init__


def _counting_init(self, *args, **kwargs):
    with open(os.environ["PARSER_COUNT_FILE"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    _init(self, *args, **kwargs)


flag_checks.OneLineParser.__init__ = _counting_init
if environment.is_worker_process():
    with open(os.environ["RANK_FILE"], "a") as f:
        f.write(f"{os.environ['RANK']} {os.getpid()}\\n")
elif os.environ.get("START_FRESH_RANKS"):  # as on GPU: each rank a new python process
    launcher.fork_is_safe = lambda: False
from megatron.trainer.tasks.gpt import GPTTask
from megatron.trainer.loop.training import pretrain
sys.exit(pretrain(GPTTask(), sys.argv[1:], script=__file__))
'''


@pytest.mark.parametrize("fresh", [False, True], ids=["forked-ranks", "fresh-ranks"])
def test_two_rank_run_builds_one_parser(tmp_path: Path, fresh: bool) -> None:
    wrapper = tmp_path / "counting_pretrain.py"
    wrapper.write_text(WRAPPER)
    counts, ranks, log = tmp_path / "parsers.txt", tmp_path / "ranks.txt", tmp_path / "log.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PARSER_COUNT_FILE": str(counts), "RANK_FILE": str(ranks),
           **({"START_FRESH_RANKS": "1"} if fresh else {})}
    proc = subprocess.Popen(
        [sys.executable, str(wrapper), "--pipeline-model-parallel-size", "2", "--device", "cpu",
         "--train-iters", "2", "--log-interval", "1", "--log-json", str(log)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert len(log.read_text().splitlines()) == 2, out  # both ranks trained: two logged iterations
    assert counts.read_text().split() == [str(proc.pid)], "only the launcher builds a parser"
    if fresh:
        started = sorted(line.split()[0] for line in ranks.read_text().splitlines())
        assert started == ["0", "1"]


def test_handed_config_is_the_launchers(tmp_path: Path, monkeypatch) -> None:
    """What a rank reads is what the launcher validated, derived values included, and frozen."""
    config = preflight(GPTTask(), ["--pipeline-model-parallel-size", "2", "--num-layers", "4"])
    with run_plan_file(config) as env:
        handed = read_run_plan(env[RUN_PLAN_ENV])
        path = Path(env[RUN_PLAN_ENV])
    assert not path.exists()
    assert handed == config  # every section, field by field
    assert handed.run == config.run and handed.batch == config.batch
    assert handed.vocab == config.vocab and handed.embeddings == config.embeddings
    with pytest.raises(dataclasses.FrozenInstanceError):
        handed.model.hidden_size = 8  # type: ignore[misc]
