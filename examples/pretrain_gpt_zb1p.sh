#!/bin/bash
# GPT with Zero Bubble ZB-1P: B/W split, order searched from F/B/W/comm times profiled in the
# first ZB_PROFILE_ITERS iterations within 1F1B's activation memory (N micro-batches,
# ZB_MEMORY_LIMIT), optimizer post-validation instead of a pipeline-wide step (POST_VALIDATION=0
# keeps the synchronous step).
# An 8-GPU node by default, a tiny model on CPU without a GPU; overrides: examples/common.sh.
set -euo pipefail
source "$(dirname "$0")/common.sh"
SCHEDULE="${SCHEDULE:-zb-1p}"
run_example gpt
