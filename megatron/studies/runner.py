"""Run a study's grid on the emulator, ``jobs`` runs at a time, and collect the loss curves.

Each run is a fresh process forked from this one (torch and megatron-core already imported, so
a run pays only for its model), or spawned where forking is unsafe. A run's result is saved as
``runs/<name>.json`` together with its flags; a re-run of the study reuses results whose flags
are unchanged, so an interrupted study resumes where it stopped.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron.studies.grid import RunSpec

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_VOCAB = 1024


@dataclass(frozen=True)
class StudyData:
    """The flags that point a run at the corpus and tokenizer."""

    prefix: str  # the indexed dataset (``tools/preprocess_data.py --output-prefix`` + ``_text_document``)
    tokenizer_dir: str  # ``tools/train_tokenizer.py --output-dir``

    @property
    def tokenizer_flags(self) -> tuple[str, ...]:
        tok = Path(self.tokenizer_dir)
        return ("--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tok / "vocab.json"),
                "--merge-file", str(tok / "merges.txt"))

    @property
    def flags(self) -> tuple[str, ...]:
        """98 % of the documents train, 2 % validate (the PACI paper's split)."""
        return ("--data-path", self.prefix, "--split", "98,2,0", *self.tokenizer_flags)


def prepare_data(directory: Path) -> StudyData:
    """The repo's offline corpus (CPython's documentation, one document per paragraph), a BPE
    tokenizer trained on it, and its indexed dataset, built once under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    tok, corpus, prefix = directory / "tokenizer", directory / "corpus.jsonl", directory / "corpus"
    if not (tok / "merges.txt").exists():
        _tool("train_tokenizer.py", "--output-dir", str(tok), "--vocab-size", str(TOKENIZER_VOCAB))
    if not corpus.exists():
        _tool("make_corpus.py", "--output", str(corpus), "--granularity", "paragraph")
    data = StudyData(f"{prefix}_text_document", str(tok))
    if not Path(f"{prefix}_text_document.idx").exists():
        _tool("preprocess_data.py", "--input", str(corpus), "--output-prefix", str(prefix), "--append-eod",
              "--workers", "1", *data.tokenizer_flags)
    return data


def _tool(name: str, *argv: str) -> None:
    """Data tools run in a subprocess: the tokenizer's threads must not live in a process we fork."""
    proc = subprocess.run([sys.executable, str(REPO / "tools" / name), *argv], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    if proc.returncode != 0:
        raise RuntimeError(f"tools/{name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def run_argv(spec: RunSpec, data: StudyData, out_dir: Path) -> list[str]:
    """The full ``pretrain_gpt.py`` flags of one run; each run has its own dataset-index cache
    (runs in parallel must not race on building the same one)."""
    return [*spec.flags, *data.flags, "--data-cache-path", str(out_dir / "cache" / spec.name),
            "--log-json", str(out_dir / "runs" / f"{spec.name}.jsonl")]


def check_argv(argv: Sequence[str]) -> None:
    """Parse one run's flags here, before any run starts: a bad grid fails in one line, at once."""
    from megatron.trainer.config.arguments import build_parser
    from megatron.trainer.plan.parse import parse_args
    from megatron.trainer.tasks.gpt import GPTTask

    parser = build_parser()
    GPTTask().add_arguments(parser)
    parse_args(list(argv), parser)


def run_study(specs: Sequence[RunSpec], data: StudyData, out_dir: Path, jobs: int,
              say: Callable[[str], None] = print) -> list[dict]:
    """Results of every spec (in ``specs``' order), running those without a saved result."""
    for d in ("runs", "logs", "cache"):
        (out_dir / d).mkdir(parents=True, exist_ok=True)
    argvs = {s.name: run_argv(s, data, out_dir) for s in specs}
    for argv in argvs.values():
        check_argv(argv)
    results = {s.name: r for s in specs if (r := _saved(out_dir, s, argvs[s.name])) is not None}
    todo = sorted((s for s in specs if s.name not in results), key=lambda s: -s.depth)  # longest first
    say(f"[study] {len(specs)} runs: {len(results)} saved, {len(todo)} to run, {jobs} at a time")
    started = time.perf_counter()
    if todo:
        with _context().Pool(jobs, maxtasksperchild=1) as pool:
            tasks = [(s, argvs[s.name], str(out_dir / "logs" / f"{s.name}.log")) for s in todo]
            for done, (spec, code, wall) in enumerate(pool.imap_unordered(_run_one, tasks), 1):
                if code != 0:
                    raise RuntimeError(f"run {spec.name} exited {code}; see {out_dir / 'logs' / spec.name}.log")
                results[spec.name] = _collect(out_dir, spec, argvs[spec.name], wall)
                loss = results[spec.name]["loss"]
                say(f"[study] {done}/{len(todo)} {spec.name}: final loss {loss[-1]:.3f} in {wall:.0f} s "
                    f"({time.perf_counter() - started:.0f} s elapsed)")
    return [results[s.name] for s in specs]


def _context() -> multiprocessing.context.BaseContext:
    from megatron.trainer.launch.launcher import fork_is_safe

    return multiprocessing.get_context("fork" if fork_is_safe() else "spawn")


def _run_one(task: tuple[RunSpec, list[str], str]) -> tuple[RunSpec, int, float]:
    """In the child: train one run with its output in its log file; return its exit code."""
    spec, argv, log = task
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    json_log = Path(argv[argv.index("--log-json") + 1])
    json_log.unlink(missing_ok=True)  # --log-json appends
    from megatron.trainer.tasks.gpt import GPTTask
    from megatron.trainer.loop.trainer import pretrain

    start = time.perf_counter()
    try:
        code = pretrain(GPTTask(), argv, script="pretrain_gpt.py")
    except SystemExit as exc:  # a Pool worker must return, not exit
        code = exc.code if isinstance(exc.code, int) else 1
    except Exception:  # noqa: BLE001 - reported through the exit code and the log
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return spec, code, time.perf_counter() - start


def _collect(out_dir: Path, spec: RunSpec, argv: list[str], wall: float) -> dict:
    """The run's curves from its ``--log-json`` records, saved as ``runs/<name>.json``."""
    records = [json.loads(line) for line in (out_dir / "runs" / f"{spec.name}.jsonl").read_text().splitlines()]
    train = [r for r in records if "eval_split" not in r]
    valid = [r for r in records if r.get("eval_split") == "valid"]
    tokens_per_update = _flag(argv, "--global-batch-size") * _flag(argv, "--seq-length")
    result = {
        "name": spec.name, "study": spec.study, "method": spec.method, "schedule": spec.schedule,
        "depth": spec.depth, "argv": argv, "wall_s": wall,
        "iterations": [r["iteration"] for r in train],
        "tokens": [r["iteration"] * tokens_per_update for r in train],
        "loss": [r["loss"] for r in train],
        "drift_max": [max(r["drift_max"][s] for r in train) for s in range(spec.depth)],
        "eval": [{"iteration": r["iteration"], "tokens": r["iteration"] * tokens_per_update, "loss": r["eval_loss"]}
                 for r in valid],
    }
    (out_dir / "runs" / f"{spec.name}.json").write_text(json.dumps(result))
    return result


def _flag(argv: list[str], name: str) -> int:
    return int(argv[argv.index(name) + 1])


def _saved(out_dir: Path, spec: RunSpec, argv: list[str]) -> dict | None:
    path = out_dir / "runs" / f"{spec.name}.json"
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    return result if result.get("argv") == argv else None
