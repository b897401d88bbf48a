#!/bin/bash
# GPT with asynchronous 1F1B (PipeDream without weight stashing): no flush, one stage-local
# update per micro-batch (MICRO_BATCHES=1), drift up to N-1-s versions on stage s.
# An 8-GPU node by default, a tiny model on CPU without a GPU; overrides: examples/common.sh.
set -euo pipefail
source "$(dirname "$0")/common.sh"
SCHEDULE="${SCHEDULE:-async-1f1b}"
run_example gpt
