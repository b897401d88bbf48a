#!/bin/bash
# GPT with Megatron's interleaved 1F1B: v model chunks per stage (LAYERS_PER_VIRTUAL_STAGE layers
# each, default 1): bubble (N-1)/(v m + N-1) with v chunks; m a multiple of the stage count.
# An 8-GPU node by default, a tiny model on CPU without a GPU; overrides: examples/common.sh.
set -euo pipefail
source "$(dirname "$0")/common.sh"
SCHEDULE="${SCHEDULE:-interleaved-1f1b}"
run_example gpt
