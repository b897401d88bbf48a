"""The trainer reads top to bottom (issue #41 item 4): from argv to the first F, ``pretrain`` and
its :class:`~megatron.trainer.loop.trainer.Trainer` make at most 12 calls into other modules, and
never go back to a module they have left.

Measured, not asserted from the source: a profile hook records every call a function of
``loop/trainer.py`` makes into another project module, in order, until the first
``StageWorker.forward``; a tiny GPT runs one iteration on one rank (the runtime, in this process
as a lone rank does) and in the emulator, each in a fresh interpreter.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAINER = "megatron/trainer/loop/trainer.py"
#: modules the path may go back to (none)
KNOWN_RETURNS: set[str] = set()

TRACER = r"""
import json, os, sys
from megatron.pipeline.runtime.worker import StageWorker
from megatron.trainer.loop.trainer import pretrain
from megatron.trainer.tasks.gpt import GPTTask
root, trainer = os.getcwd() + "/", sys.argv[1]
steps, done = [], []
def where(code):
    return code.co_filename.replace(root, "")
def hook(frame, event, arg):
    if done or event != "call":
        return
    code, caller = frame.f_code, frame.f_back
    if code is StageWorker.forward.__code__:
        done.append(1)
    elif (caller is not None and where(caller.f_code) == trainer and where(code).startswith("megatron/")
          and where(code) != trainer and not code.co_name.startswith(("<", "__"))):
        steps.append(f"{where(code)}:{code.co_name}")
argv = ["--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8", "--vocab-size", "32",
        "--micro-batch-size", "1", "--num-threads", "1", "--num-layers", "2", "--global-batch-size", "2",
        "--train-iters", "1", "--mock-data", "--device", "cpu", *sys.argv[3:]]
sys.setprofile(hook)
pretrain(GPTTask(), argv)
sys.setprofile(None)
assert done, "no F ran"
with open(sys.argv[2], "w") as f:
    json.dump(steps, f)
"""


def _path(tmp_path: Path, *flags: str) -> list[str]:
    out = tmp_path / "path.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", TRACER, TRAINER, str(out), *flags], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=600)
    return json.loads(out.read_text())


@pytest.mark.parametrize("flags", [(), ("--pipeline-executor", "emulator", "--pipeline-model-parallel-size", "2")],
                         ids=["one-rank", "emulator"])
def test_argv_to_the_first_f_is_short_and_never_turns_back(tmp_path: Path, flags: tuple[str, ...]) -> None:
    steps = _path(tmp_path, *flags)
    assert steps[0].endswith(":enter_process") and steps[-1].endswith("segments.py:run_segments"), steps
    assert len(steps) <= 12, "\n".join(steps)
    files = [s.split(":")[0] for s in steps]
    left: set[str] = set()
    for previous, current in zip(files, files[1:]):
        if current != previous:
            left.add(previous)
            assert current not in left - KNOWN_RETURNS, f"returns to {current}:\n" + "\n".join(steps)
