#!/bin/bash
# GPT with V-Half: about half of 1F1B's activation memory on the V placement.
# Two model chunks per stage (stage s holds virtual stages s and 2N-1-s); layers split evenly
# into 2N parts. An 8-GPU node by default, a tiny model on CPU without a GPU; overrides: examples/common.sh.
set -euo pipefail
source "$(dirname "$0")/common.sh"
SCHEDULE="${SCHEDULE:-v-half}"
run_example gpt
