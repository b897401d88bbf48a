"""Download the wheels an offline GPU node needs to run this project (``tools/make_wheelhouse.sh``).

Why: the GPU nodes have no network, a CUDA torch of their own and no megatron-core or nltk.
``pip download`` of ``.`` would drag in a CPU or CUDA torch (GBs) through megatron-core's own
``torch`` requirement, and pip cannot leave one requirement out. So the download runs in two
phases, both for the *target's* Python and manylinux x86_64 (``--python-version``, ``--abi``,
``--platform``, binary wheels only):

1. every ``[project] dependencies`` entry of ``pyproject.toml`` except torch, ``--no-deps``;
2. *with* their dependencies: those of phase 1 whose wheel does not require torch, and for
   one that does (megatron-core) the other requirements its wheel declares (markers evaluated
   for the target, extras skipped). A torch wheel in the directory afterwards is an error.

Then every wheel's tags are checked against the target and the directory's size against the
limit (60 MB: what fits next to the repository in one 64 MiB carry to the device machine).
``--skip-present FILE`` drops wheels whose distribution FILE names (one per line, ``#``
comments): the packages the GPU image already has, for a smaller carry.

``--list`` prints the plan (phase-1 requirements and the pip flags) without any network: the
CI test checks it.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip vendors a TOML reader
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ModuleNotFoundError:  # pip's vendored copy is always there where pip is
    from pip._vendor.packaging.markers import default_environment  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parent.parent
LIMIT_BYTES = 60 * 10**6
# What the node brings itself: its CUDA torch (and through it triton, nvidia-* libraries).
EXCLUDED = frozenset({"torch"})
# manylinux tags pip accepts for an x86_64 glibc >= 2.28 node (pip matches each tag exactly);
# "any" admits pure-Python wheels.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "any")


@dataclass(frozen=True)
class Target:
    """The interpreter the wheels are for: ``python`` is "3.12"-style."""
    python: str

    @property
    def nodot(self) -> str:
        return self.python.replace(".", "")

    def pip_flags(self) -> list[str]:
        flags = ["--only-binary=:all:", "--python-version", self.python, "--implementation", "cp",
                 "--abi", f"cp{self.nodot}", "--abi", "abi3", "--abi", "none"]
        for platform in PLATFORMS:
            flags += ["--platform", platform]
        return flags

    def marker_environment(self) -> dict[str, str]:
        env = dict(default_environment())
        env.update(python_version=self.python, python_full_version=f"{self.python}.0", sys_platform="linux",
                   platform_system="Linux", platform_machine="x86_64", os_name="posix",
                   implementation_name="cpython", platform_python_implementation="CPython")
        return env

    def accepts(self, filename: str) -> bool:
        """Whether pip on the target would install this wheel file (tags checked, not contents)."""
        _, _, _, tags = parse_wheel_filename(filename)
        return any(self._interpreter_ok(t.interpreter, t.abi) and self._platform_ok(t.platform) for t in tags)

    def _interpreter_ok(self, interpreter: str, abi: str) -> bool:
        if interpreter in (f"cp{self.nodot}", "py3", f"py{self.nodot}"):
            return abi in (f"cp{self.nodot}", "abi3", "none")
        match = re.fullmatch(r"cp3(\d+)", interpreter)  # abi3: built for an older CPython 3
        return abi == "abi3" and match is not None and int(match.group(1)) <= int(self.nodot[1:])

    @staticmethod
    def _platform_ok(platform: str) -> bool:
        return platform == "any" or (platform.startswith("manylinux") and platform.endswith("_x86_64"))


def project_requirements(pyproject: Path = REPO / "pyproject.toml") -> list[Requirement]:
    """Phase 1: ``[project] dependencies`` without what the node brings (torch)."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    reqs = [Requirement(d) for d in deps]
    return [r for r in reqs if canonicalize_name(r.name) not in EXCLUDED]


def wheel_requirements(metadata: str, target: Target) -> list[Requirement]:
    """The ``Requires-Dist`` lines of a wheel's METADATA that apply on ``target`` (no extras)."""
    env = dict(target.marker_environment(), extra="")
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in metadata.splitlines()
            if line.startswith("Requires-Dist:")]
    return [r for r in reqs if not r.marker or r.marker.evaluate(env)]


def second_phase(first: list[Requirement], metadata: dict[str, str], target: Target) -> list[str]:
    """Phase 2's requirements: a phase-1 requirement whose wheel needs torch is replaced by that
    wheel's other requirements (pip would otherwise resolve torch); the rest stay as they are.
    ``metadata`` maps canonical names of the phase-1 wheels to their METADATA text."""
    out: set[str] = set()
    for req in first:
        needs = wheel_requirements(metadata[canonicalize_name(req.name)], target)
        if any(canonicalize_name(r.name) in EXCLUDED for r in needs):
            out.update(str(r) for r in needs if canonicalize_name(r.name) not in EXCLUDED)
        else:
            out.add(str(req))
    return sorted(out)


def wheel_metadata(path: Path) -> str:
    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return zf.read(name).decode()


def read_names(path: Path) -> set[str]:
    """Distribution names, one per line; ``#`` starts a comment."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {canonicalize_name(line) for line in lines if line}


def wheel_name(filename: str) -> str:
    return canonicalize_name(parse_wheel_filename(filename)[0])


def pip_download(reqs: list[str], dest: Path, target: Target, no_deps: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest), *target.pip_flags()]
    cmd += ["--no-deps"] if no_deps else []
    subprocess.run([*cmd, *reqs], check=True)


def check(dest: Path, target: Target) -> list[str]:
    """Problems of a finished wheelhouse: excluded wheels, wrong tags, two versions, size."""
    wheels = sorted(dest.glob("*.whl"))
    problems = [f"{w.name}: excluded (the node brings it)" for w in wheels if wheel_name(w.name) in EXCLUDED]
    problems += [f"{w.name}: not installable on CPython {target.python} manylinux x86_64"
                 for w in wheels if not target.accepts(w.name)]
    names = [wheel_name(w.name) for w in wheels]
    problems += [f"{n}: more than one version" for n in sorted({n for n in names if names.count(n) > 1})]
    size = sum(w.stat().st_size for w in wheels)
    if size >= LIMIT_BYTES:
        problems.append(f"{size / 1e6:.1f} MB >= {LIMIT_BYTES / 1e6:.0f} MB")
    return problems


def build(dest: Path, target: Target, skip: set[str]) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    first = project_requirements()
    pip_download([str(r) for r in first], dest, target, no_deps=True)
    first_names = {canonicalize_name(r.name) for r in first}
    metadata = {wheel_name(w.name): wheel_metadata(w) for w in dest.glob("*.whl") if wheel_name(w.name) in first_names}
    pip_download(second_phase(first, metadata, target), dest, target, no_deps=False)
    for wheel in dest.glob("*.whl"):
        if wheel_name(wheel.name) in skip:
            wheel.unlink()
    problems = check(dest, target)
    wheels = sorted(dest.glob("*.whl"))
    for w in wheels:
        print(f"{w.stat().st_size / 1e6:7.2f} MB  {w.name}")
    print(f"{len(wheels)} wheels, {sum(w.stat().st_size for w in wheels) / 1e6:.1f} MB in {dest}")
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dest", type=Path)
    p.add_argument("--python", default="3.12", choices=["3.10", "3.11", "3.12", "3.13"])
    p.add_argument("--skip-present", type=Path, default=None, metavar="FILE",
                   help="leave out the distributions FILE names (what the node already has)")
    p.add_argument("--list", action="store_true", help="print the plan, download nothing")
    args = p.parse_args(argv)
    target = Target(args.python)
    skip = read_names(args.skip_present) if args.skip_present else set()
    if args.list:
        print("phase 1 (--no-deps):", " ".join(str(r) for r in project_requirements()))
        print("phase 2 (with dependencies): phase 1 + the Requires-Dist of its wheels, torch left out")
        print("pip flags:", " ".join(target.pip_flags()))
        print("skipped:", " ".join(sorted(skip)) or "-")
        return 0
    return build(args.dest, target, skip)


if __name__ == "__main__":
    sys.exit(main())
