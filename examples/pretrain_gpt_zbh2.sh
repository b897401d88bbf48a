#!/bin/bash
# GPT with Zero Bubble ZB-H2: 2(N-s)-1 warm-up forwards and W delayed by 2s backwards; bubble-free
# at equal F/B/W times once m >= 2N - 1 (MICRO_BATCHES defaults to 2N), up to (2N-1) micro-batches
# of activations; optimizer post-validation keeps the parallelogram across iterations (the paper's
# setting; POST_VALIDATION=0 keeps the synchronous step).
# An 8-GPU node by default, a tiny model on CPU without a GPU; overrides: examples/common.sh.
set -euo pipefail
source "$(dirname "$0")/common.sh"
SCHEDULE="${SCHEDULE:-zb-h2}"
run_example gpt
