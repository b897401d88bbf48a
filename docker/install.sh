#!/bin/bash
# Install this repository into a Python environment that already has its torch (the NGC PyTorch
# image: torch, Transformer Engine and Apex built for its CUDA), without replacing that torch.
#
# pip gets a constraints file that pins every installed torch-family package (torch, triton,
# Transformer Engine, Apex, numpy, NVIDIA CUDA wheels) to the version the environment has, so
# the resolver keeps them or fails; it never downloads another torch. megatron-core comes at
# the version pyproject.toml pins (0.16.1). --no-build-isolation builds the editable install
# with the environment's setuptools (no download). Afterwards the torch version is checked.
#
#   bash docker/install.sh                          # what the Dockerfile runs
#   EXTRAS=test bash docker/install.sh              # with pytest and tensorboard
#   bash docker/install.sh --dry-run --no-index     # extra arguments go to pip install
# Environment: PYTHON (python), EXTRAS (pyproject extras, comma-separated; default none).
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT

installed_torch() {
    "$PYTHON" -c 'import importlib.metadata as md; print(md.version("torch"))'
}

TORCH_BEFORE="$(installed_torch)" || {
    echo "error: $PYTHON has no torch; this installer keeps an existing torch (NGC image). On a plain" \
         "machine install torch first (README: pip install torch==2.13.0)" >&2
    exit 2
}
"$PYTHON" - > "$CONSTRAINTS" <<'PY'
import importlib.metadata as md
import re

KEEP = re.compile(r"^(torch|torchvision|torchaudio|triton|pytorch-triton|transformer[-_]engine.*|apex|numpy|nvidia-.*)$")
pins = {}
for dist in md.distributions():
    name = (dist.metadata["Name"] or "").lower().replace("_", "-")
    if KEEP.match(name):
        pins[name] = dist.version
for name in sorted(pins):
    print(f"{name}=={pins[name]}")
PY
echo "[install] keeping the installed versions of:" $(cat "$CONSTRAINTS") >&2

TARGET="$REPO_DIR"
if [[ -n "${EXTRAS:-}" ]]; then TARGET="$REPO_DIR[$EXTRAS]"; fi
set -x
"$PYTHON" -m pip install --no-build-isolation -c "$CONSTRAINTS" -e "$TARGET" "$@"
{ set +x; } 2>/dev/null

TORCH_AFTER="$(installed_torch)"
if [[ "$TORCH_AFTER" != "$TORCH_BEFORE" ]]; then
    echo "error: torch changed from $TORCH_BEFORE to $TORCH_AFTER during the install" >&2
    exit 1
fi
echo "[install] done; torch $TORCH_AFTER untouched" >&2
