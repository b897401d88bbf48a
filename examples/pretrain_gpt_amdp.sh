#!/bin/bash
# GPT with AMDP: D/2 replicated pipelines over D devices in alternating directions, injection
# limit 2, windowed updates (drift <= 1); uses all GPUs of all nodes as pipeline stages (DP = 1),
# MICRO_BATCHES a multiple of the stage count.
# An 8-GPU node by default, a tiny model on CPU without a GPU; overrides: examples/common.sh.
set -euo pipefail
source "$(dirname "$0")/common.sh"
SCHEDULE="${SCHEDULE:-amdp}"
run_example gpt
