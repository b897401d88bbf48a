#!/usr/bin/env bash
# Wheels for an offline GPU node (its own CUDA torch, no network): megatron-core 0.16.1, nltk and
# everything else `pip install -e .` pulls, for one CPython and manylinux x86_64; torch left out.
#   tools/make_wheelhouse.sh DIR [--python 3.12] [--skip-present FILE] [--list]
# Details: tools/wheelhouse.py; how the GPU check uses it: docs/gpu.md, "Run the GPU check".
set -euo pipefail
exec python3 "$(dirname "$0")/wheelhouse.py" "$@"
