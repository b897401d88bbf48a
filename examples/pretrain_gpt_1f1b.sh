#!/bin/bash
# GPT with Megatron's 1F1B and a pipeline flush: bubble (N-1)/(m+N-1), no weight drift.
# An 8-GPU node by default, a tiny model on CPU without a GPU; overrides: examples/common.sh.
set -euo pipefail
source "$(dirname "$0")/common.sh"
SCHEDULE="${SCHEDULE:-1f1b}"
run_example gpt
