"""README.md's shell blocks run as written, so the documentation cannot rot.

Every ```bash block after the first (the first is the install + test commands, which
``.ci/run`` executes itself, see ``.ci/readme_commands.py``) runs in order in one scratch
directory that links the repository's files, so the outputs of one block (corpus, tokenizer,
datasets) feed the next exactly as for a user following the README. Not run:

* lines whose trailing comment starts with ``gpu`` or ``long`` (GPU-only or long-running);
* cluster and container commands (``sbatch``, ``srun``, ``salloc``, ``scontrol``, ``docker``).

Shrinking is explicit and small: ``--train-iters N`` in a snippet is capped at :data:`CAP`;
the examples get their documented environment overrides ``FORCE_CPU=1``,
``EXECUTOR=emulator`` (one process instead of four torchrun ranks, each paying megatron-core's
import) and ``TRAIN_ITERS`` = :data:`EXAMPLE_ITERS`, which also caps a snippet's own
``TRAIN_ITERS=N``. Everything else runs verbatim. The test also checks
that ``.gitignore`` names everything the snippets create, and that no rank printed
megatron-core's per-import optional-package warnings.
"""
from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CAP = 20  # iterations of a direct pretrain_*.py line
EXAMPLE_ITERS = 2  # iterations of an examples/*.sh line
SKIP_TAGS = ("gpu", "long")
CLUSTER_PROGRAMS = {"sbatch", "srun", "salloc", "scontrol", "docker"}


def bash_blocks(text: str) -> list[list[str]]:
    """The ```bash blocks of ``text``, each as logical lines (backslash continuations joined)."""
    blocks, current, inside = [], [], False
    for line in text.splitlines():
        stripped = line.strip()
        if not inside and stripped.startswith("```bash"):
            inside, current = True, []
        elif inside and stripped.startswith("```"):
            inside = False
            blocks.append(current)
        elif inside:
            if current and current[-1].endswith("\\"):
                current[-1] = current[-1][:-1].rstrip() + " " + stripped
            elif stripped and not stripped.startswith("#"):
                current.append(stripped)
    return blocks


def skip_reason(line: str) -> str | None:
    """Why ``line`` is not run, or None."""
    tag = re.search(r"\s#\s*(\w+)", line)
    if tag and tag.group(1) in SKIP_TAGS:
        return f"marked # {tag.group(1)}"
    words = [w for w in shlex.split(line, comments=True) if not re.match(r"^[A-Z_][A-Z0-9_]*=", w)]
    if words and words[0] in CLUSTER_PROGRAMS:
        return f"{words[0]}: cluster or container"
    return None


def cap_iterations(line: str) -> str:
    line = re.sub(r"(--train-iters[ =])(\d+)", lambda m: m.group(1) + str(min(int(m.group(2)), CAP)), line)
    return re.sub(r"\b(TRAIN_ITERS=)(\d+)", lambda m: m.group(1) + str(min(int(m.group(2)), EXAMPLE_ITERS)), line)


def test_readme_blocks_parse() -> None:
    """The parser itself: continuations, comments, tags and caps (fails if the rules rot)."""
    blocks = bash_blocks("```bash\n# c\na \\\n  b  # gpu: x\nTRAIN_ITERS=2000 sbatch s\n```\n")
    assert blocks == [["a b  # gpu: x", "TRAIN_ITERS=2000 sbatch s"]]
    assert [skip_reason(line) for line in blocks[0]] == ["marked # gpu", "sbatch: cluster or container"]
    assert cap_iterations("x --train-iters 2000 TRAIN_ITERS=5 --train-iters=300") == \
        f"x --train-iters {CAP} TRAIN_ITERS={EXAMPLE_ITERS} --train-iters={CAP}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _gitignored_roots() -> set[str]:
    roots = set()
    for line in (REPO / ".gitignore").read_text().splitlines():
        if line.startswith("/"):
            roots.add(line.strip("/"))
    return roots


def test_readme_snippets_run_verbatim(tmp_path: Path) -> None:
    blocks = bash_blocks((REPO / "README.md").read_text())[1:]
    assert len(blocks) >= 5, "README lost its shell blocks?"
    for entry in REPO.iterdir():
        if not entry.name.startswith(".") and entry.name not in _gitignored_roots() | {"__pycache__"}:
            (tmp_path / entry.name).symlink_to(entry)
    linked = {p.name for p in tmp_path.iterdir()}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(FORCE_CPU="1", EXECUTOR="emulator", TRAIN_ITERS=str(EXAMPLE_ITERS), OMP_NUM_THREADS="1",
               MASTER_PORT=str(_free_port()))
    ran, skipped = 0, []
    for block in blocks:
        lines = []
        for line in block:
            reason = skip_reason(line)
            if reason:
                skipped.append(f"{reason}: {line[:60]}")
            else:
                lines.append(cap_iterations(line))
        if not lines:
            continue
        script = "set -euo pipefail\n" + "\n".join(lines) + "\n"
        proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=400)
        assert proc.returncode == 0, f"README block failed:\n{script}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        assert not re.search(r"(Apex|Transformer Engine).*not installed", proc.stderr), proc.stderr[-2000:]
        ran += len(lines)
    assert ran >= 12 and len(skipped) <= 6, skipped
    created = {p.name for p in tmp_path.iterdir()} - linked
    assert created <= _gitignored_roots(), f"add to .gitignore: {sorted(created - _gitignored_roots())}"
