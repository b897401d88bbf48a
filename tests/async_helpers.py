"""Helpers for tests that train tiny GPTs through the trainer (emulator or distributed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.adam_bounds import assert_within_bounds, gpt_gradient_noise, trace_adam

REPO = Path(__file__).resolve().parent.parent

TINY_GPT = [
    "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8", "--vocab-size", "32",
    "--micro-batch-size", "1", "--num-threads", "1", "--lr", "1e-2", "--lr-warmup-iters", "1",
    # Tests compare schedules and layouts with each other; only synchronous schedules tie by
    # default (tests/test_tied_embeddings.py covers tying), so the tiny GPT is untied everywhere.
    "--untie-embeddings-and-output-weights",
]


def tiny_args(num_stages: int, schedule: str, accumulation: int, iters: int, *extra: str) -> list[str]:
    """Flags of a tiny GPT run with ``accumulation`` micro-batches per update."""
    return [
        *TINY_GPT, "--num-layers", str(num_stages), "--pipeline-model-parallel-size", str(num_stages),
        "--pipeline-schedule", schedule, "--global-batch-size", str(accumulation),
        "--train-iters", str(iters), "--log-interval", "1", *extra,
    ]


def _parse(argv: list[str], task):
    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_run_plan

    parser = build_parser()
    task.add_arguments(parser)
    return parse_run_plan(argv, parser)


def emulate(argv: list[str], task=None):
    """Run the emulator in this process (needs the ``megatron_world1`` fixture); return workers.

    ``task`` defaults to GPT; a task with its own flags (BERT) gets them on the parser."""
    from megatron.trainer.tasks.gpt import GPTTask
    from megatron.trainer.loop.training import emulate as run

    task = task or GPTTask()
    return run(task, _parse(argv, task))


@dataclass
class Reference:
    """An in-process emulator run with the tolerances derived from its own Adam steps
    (tests/adam_bounds.py): ``rho`` for losses and norms, ``bounds`` per parameter element."""

    records: list[dict]
    params: dict[str, torch.Tensor]
    bounds: dict[str, torch.Tensor]
    rho: float


def emulated_reference(argv: list[str], log: Path) -> Reference:
    """Train a GPT ``argv`` in the emulator (needs ``megatron_world1``), tracing its AdamW steps."""
    from megatron.trainer.tasks.gpt import GPTTask

    argv = [*argv, "--pipeline-executor", "emulator", "--log-json", str(log)]
    config = _parse(argv, GPTTask())
    model = config.model
    rho = gpt_gradient_noise(model.num_layers, model.hidden_size, model.ffn_hidden_size or 4 * model.hidden_size,
                             config.vocab.size,
                             model.seq_length * config.training.global_batch_size)
    with trace_adam() as trace:
        workers = emulate(argv)
    bounds = {name: trace.bound(name, p, rho) for w in workers for name, p in named_parameters(w)}
    return Reference(read_log(log), final_params(workers), bounds, rho)


def assert_trains_like(records: list[dict], params: dict[str, torch.Tensor], ref: Reference,
                       keys: tuple[str, ...] = ("loss", "grad_norm", "params_norm"), context: str = "") -> None:
    """Another reduction order's run against ``ref``: the same iterations, every logged ``key``
    within ``rho`` relative, every parameter element within its derived bound."""
    assert [r.get("iteration") for r in records] == [r.get("iteration") for r in ref.records], context
    for ours, want in zip(records, ref.records):
        for key in keys:
            if key in want:
                assert ours[key] == pytest.approx(want[key], rel=ref.rho), (context, key, ours, want)
    assert_within_bounds(params, ref.params, ref.bounds, context=context)


def final_params(workers) -> dict[str, torch.Tensor]:
    out = {}
    for w in workers:
        for name, p in named_parameters(w):
            out[name] = p.detach().clone()
    return out


def named_parameters(worker):
    """A GPT worker's parameters under their global names (the names of ``--dump-final-params``)."""
    from megatron.trainer.tasks.gpt import GPTTask

    return GPTTask().named_parameters(worker.setup.chunks)


def run_pretrain(argv: list[str], out_dir: Path, timeout: float = 240,
                 script: str = "pretrain_gpt.py") -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Run ``script`` as a subprocess; return its JSON records and final parameters."""
    log, dump = out_dir / "log.jsonl", out_dir / "params"
    cmd = [sys.executable, str(REPO / script), *argv, "--log-json", str(log), "--dump-final-params", str(dump)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "stderr.txt").write_text(proc.stderr)  # every rank's warnings and skip lines
    (out_dir / "stdout.txt").write_text(proc.stdout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [r for r in read_log(log) if "eval_split" not in r]  # training records
    params: dict[str, torch.Tensor] = {}
    for f in sorted(dump.glob("stage*.pt")):
        params.update(torch.load(f))
    return records, params


def read_log(path: Path) -> list[dict]:
    """All ``--log-json`` records (training and evaluation)."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def eval_records(out_dir: Path) -> list[dict]:
    """The evaluation records of a :func:`run_pretrain` run in ``out_dir``."""
    return [r for r in read_log(out_dir / "log.jsonl") if "eval_split" in r]


def assert_runtime_equals_emulator(argv: list[str], out_dir: Path) -> tuple[list[dict], list]:
    """Train ``argv`` through the distributed runtime and the emulator (needs ``megatron_world1``);
    assert bitwise-equal final parameters; return the runtime's records and the emulator's workers."""
    records, dist_params = run_pretrain(argv, out_dir)
    workers = emulate([*argv, "--pipeline-executor", "emulator"])
    emu_params = final_params(workers)
    assert dist_params.keys() == emu_params.keys()
    for name, value in dist_params.items():
        assert torch.equal(value, emu_params[name]), name
    return records, workers


def assert_emulated_resume_is_bitwise(argv: list[str], total: int, stop: int, tmp_path: Path) -> None:
    """``argv`` (``total`` iterations, needs ``megatron_world1``) stopped at a checkpoint after
    ``stop`` and resumed equals the run trained straight through (saving at the same cut):
    the same losses at every iteration, bitwise-equal final parameters."""
    from megatron.trainer.checkpointing import checkpoint as ckpt

    def run(tag: str, *more: str) -> tuple[dict[str, torch.Tensor], list[tuple[int, float]]]:
        log = tmp_path / f"{tag}.jsonl"
        params = final_params(emulate([*argv, "--log-json", str(log), *more]))
        return params, [(r["iteration"], r["loss"]) for r in read_log(log) if "loss" in r]

    straight, straight_losses = run("straight", "--save", str(tmp_path / "a"), "--save-interval", str(stop))
    _, first_losses = run("first", "--save", str(tmp_path / "b"), "--exit-interval", str(stop))
    assert (tmp_path / "b" / ckpt.POINTER).read_text().strip() == str(stop)
    resumed, resumed_losses = run("resumed", "--load", str(tmp_path / "b"))
    assert [it for it, _ in first_losses + resumed_losses] == list(range(1, total + 1))
    assert first_losses + resumed_losses == straight_losses
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


def assert_flag_error(capsys, argv: list[str], fragment: str) -> None:
    """``argv`` (on a 2-stage, 2-layer GPT) exits 2 with one line of stderr containing ``fragment``."""
    import pytest

    from megatron.trainer.plan.parse import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--pipeline-model-parallel-size", "2", "--num-layers", "2", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err
