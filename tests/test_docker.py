"""docker/Dockerfile without a Docker engine: what can be checked here.

- The Dockerfile parses (line continuations, comments, JSON or shell form), FROM comes first
  (only ARGs may precede it), every instruction is a known one, the base is NGC PyTorch.
- No RUN installs torch (a `pip install torch...` would replace NGC's CUDA torch).
- Every COPY/ADD source exists in the build context (the repository root), and .dockerignore
  does not exclude it.
- The install step it runs (docker/install.sh) works: a dry run in a temporary venv that sees
  this environment's packages (--system-site-packages, so torch is not downloaded), with
  --no-index (offline). It must plan to install only this repository, never torch.
"""
from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "docker" / "Dockerfile"

INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
                "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "MAINTAINER"}


class DockerfileError(ValueError):
    pass


@dataclass
class Instruction:
    line: int  # 1-based line where it starts
    name: str
    args: str


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions of a Dockerfile: joins `\\` continuations, drops comments and blank lines."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):  # comment lines inside a continuation are dropped
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1])
            continue
        pending.append(stripped)
        logical = " ".join(p.strip() for p in pending if p.strip())
        pending = []
        if "<<" in logical.split(None, 1)[-1] and re.search(r"<<-?\s*['\"]?[A-Z]+", logical):
            raise DockerfileError(f"line {start}: heredocs are not supported by this checker")
        name, _, args = logical.partition(" ")
        if name.upper() not in INSTRUCTIONS:
            raise DockerfileError(f"line {start}: unknown instruction {name!r}")
        if name != name.upper():
            raise DockerfileError(f"line {start}: write instructions in upper case ({name})")
        out.append(Instruction(start, name, args.strip()))
    if pending:
        raise DockerfileError("the file ends inside a line continuation")
    if not out:
        raise DockerfileError("no instructions")
    first = next((i for i in out if i.name != "ARG"), None)
    if first is None or first.name != "FROM":
        raise DockerfileError(f"line {first.line if first else 1}: the first instruction must be FROM (ARGs may precede it)")
    return out


def _words(args: str) -> list[str]:
    """Arguments of an instruction in JSON (exec) or shell form, without --flags."""
    if args.startswith("["):
        words = json.loads(args)
    else:
        words = shlex.split(args)
    return [w for w in words if not w.startswith("--")]


TORCH_PACKAGE = re.compile(r"^(torch|torchvision|torchaudio|pytorch|triton)([<>=!~\[;@ ].*)?$", re.I)


def installs_torch(run_args: str) -> bool:
    """Whether a RUN command line asks pip (or conda/uv) to install torch itself."""
    lexer = shlex.shlex(run_args, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|", "&", "(", ")"):
            commands.append([])
        else:
            commands[-1].append(token)
    for words in commands:
        for i, word in enumerate(words):
            pip = i > 0 and re.search(r"(^|/)(pip3?|conda|mamba|micromamba)$", words[i - 1]) or \
                i > 1 and words[i - 1] == "pip" and words[i - 2] in ("-m", "uv")
            if word == "install" and pip:
                if any(TORCH_PACKAGE.match(w) for w in words[i + 1:] if not w.startswith("-")):
                    return True
    return False


def check_dockerfile(text: str, context: Path) -> list[Instruction]:
    """All checks of the module docstring except the install run; raises DockerfileError."""
    instructions = parse_dockerfile(text)
    base = next(i for i in instructions if i.name == "FROM").args.split()[0]
    if not re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", base):
        raise DockerfileError(f"FROM {base}: expected the NGC PyTorch image nvcr.io/nvidia/pytorch:YY.MM-py3")
    ignore = _dockerignore(context)
    for ins in instructions:
        if ins.name == "RUN" and installs_torch(ins.args):
            raise DockerfileError(f"line {ins.line}: RUN installs torch, which would replace NGC's torch: {ins.args}")
        if ins.name in ("COPY", "ADD"):
            if "--from=" in ins.args:
                continue
            *sources, _dest = _words(ins.args)
            if not sources:
                raise DockerfileError(f"line {ins.line}: {ins.name} needs a source and a destination")
            for src in sources:
                path = context / src
                if not path.exists():
                    raise DockerfileError(f"line {ins.line}: {ins.name} source {src} does not exist in the build context")
                rel = src.rstrip("/")
                if any(fnmatch.fnmatch(rel, pat.rstrip("/")) for pat in ignore):
                    raise DockerfileError(f"line {ins.line}: {ins.name} source {src} is excluded by .dockerignore")
    return instructions


def _dockerignore(context: Path) -> list[str]:
    path = context / ".dockerignore"
    if not path.exists():
        return []
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


# --- the repository's Dockerfile --------------------------------------------------------------

def test_dockerfile_passes_the_checks():
    instructions = check_dockerfile(DOCKERFILE.read_text(), REPO)
    assert instructions[0].name == "FROM"
    runs = [i.args for i in instructions if i.name == "RUN"]
    assert any("docker/install.sh" in r for r in runs), "the image must install through docker/install.sh"
    copied = {w for i in instructions if i.name == "COPY" for w in _words(i.args)[:-1]}
    for needed in ("pyproject.toml", "megatron/", "pretrain_gpt.py", "pretrain_bert.py", "examples/", "docker/install.sh"):
        assert needed in copied, f"the image does not COPY {needed}"


def test_docker_readme_has_build_and_run_lines():
    text = (REPO / "docker" / "README.md").read_text()
    assert "docker build -f docker/Dockerfile" in text
    assert "torchrun" in text and "--gpus all" in text
    assert "-v " in text and "/checkpoints" in text and "/data" in text


# --- the checker itself must catch what it claims to catch ---------------------------------

GOOD = "FROM nvcr.io/nvidia/pytorch:25.09-py3\nWORKDIR /w\nCOPY pyproject.toml ./\nRUN bash docker/install.sh\n"


@pytest.mark.parametrize("text, message", [
    ("RUN echo hi\nFROM nvcr.io/nvidia/pytorch:25.09-py3\n", "first instruction must be FROM"),
    ("FROM nvcr.io/nvidia/pytorch:25.09-py3\nRUNN echo\n", "unknown instruction"),
    ("FROM ubuntu:24.04\n", "expected the NGC PyTorch image"),
    (GOOD + "RUN pip install torch==2.5.0\n", "installs torch"),
    (GOOD + "RUN apt-get update && \\\n    python -m pip install -U numpy torch\n", "installs torch"),
    (GOOD + "RUN pip3 install --upgrade 'torch>=2.6'\n", "installs torch"),
    (GOOD + "COPY no_such_file.py ./\n", "does not exist"),
    (GOOD + "COPY runs/ runs/\n", None),  # excluded by .dockerignore (or missing): must fail either way
    (GOOD + "RUN echo \\\n", "ends inside a line continuation"),
])
def test_checker_rejects_bad_dockerfiles(text, message):
    with pytest.raises(DockerfileError) as err:
        check_dockerfile(text, REPO)
    if message:
        assert message in str(err.value)


def test_checker_accepts_arg_before_from_and_torch_free_installs():
    text = "ARG X=1\n" + GOOD + "RUN pip install tokenizers torchmetrics-free-name && pip install -e .\n"
    check_dockerfile(text, REPO)
    assert not installs_torch("pip install megatron-core==0.16.1 tokenizers")
    assert installs_torch("python -m pip install torch")


# --- the install step, offline, in a throwaway venv --------------------------------------------

def test_install_script_keeps_torch_and_installs_only_this_repo(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=120)
    python = venv / "bin" / "python"
    report = tmp_path / "report.json"
    proc = subprocess.run(["bash", str(REPO / "docker" / "install.sh"), "--dry-run", "--no-index", "--report", str(report)],
                          cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "PYTHON": str(python), "HOME": str(tmp_path),
                                             "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and re.search(r"No matching distribution|Could not find a version|has no torch", out):
        pytest.skip("the offline dry run needs packages this environment lacks (no network): " + out.strip().splitlines()[-1])
    assert proc.returncode == 0, out[-3000:]
    import importlib.metadata as md

    assert f"torch=={md.version('torch')}" in out  # pinned to the installed version
    installs = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in json.loads(report.read_text())["install"]}
    assert "torch" not in installs
    assert set(installs) <= {"megatron-async", "megatron-core"}, installs
    if "megatron-core" in installs:
        assert installs["megatron-core"] == "0.16.1"


# --- what the image installs --------------------------------------------------------------------

IMAGE_NEEDS = {"pytest": "pytest", "pytest-xdist": "xdist", "tensorboard": "tensorboard",
               "matplotlib": "matplotlib", "nltk": "nltk", "regex": "regex"}  # distribution -> module


def _requirement_names(specs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[;@ ]", spec, maxsplit=1)[0].strip().lower() for spec in specs}


def test_image_installs_and_imports_what_the_tests_and_tools_need():
    """The README's tests (pytest -n 2, tensorboard and matplotlib tests) and tools/ (nltk, regex):
    declared in pyproject.toml where the image's install (EXTRAS=test) gets them, and imported
    by the build's smoke check, so a missing one fails the build rather than the first test."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runs = [i.args for i in check_dockerfile(DOCKERFILE.read_text(), REPO) if i.name == "RUN"]
    install = next(r for r in runs if "docker/install.sh" in r)
    extras = re.search(r"EXTRAS=(\S+)", install)
    assert extras, install
    declared = _requirement_names(project["dependencies"])
    for extra in extras.group(1).split(","):
        declared |= _requirement_names(project["optional-dependencies"][extra])
    assert set(IMAGE_NEEDS) <= declared, set(IMAGE_NEEDS) - declared
    imported = {name.strip() for r in runs for line in re.findall(r'python -c "import ([\w, ]+);', r)
                for name in line.split(",")}
    assert set(IMAGE_NEEDS.values()) <= imported, set(IMAGE_NEEDS.values()) - imported
