#!/bin/bash
# GPT with PipeDream-2BW: double-buffered weights, one update per MICRO_BATCHES micro-batches,
# each backward uses the weight version its forward used (1-stale updates); needs m >= N - 1.
# An 8-GPU node by default, a tiny model on CPU without a GPU; overrides: examples/common.sh.
set -euo pipefail
source "$(dirname "$0")/common.sh"
SCHEDULE="${SCHEDULE:-pipedream-2bw}"
run_example gpt
