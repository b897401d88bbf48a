#!/bin/bash
# GPT with Zero Bubble ZB-H1: 1F1B with the backward split into B and W, stage s delaying its W
# passes by s backwards: 1F1B's activation memory, about a third of its bubble.
# An 8-GPU node by default, a tiny model on CPU without a GPU; overrides: examples/common.sh.
set -euo pipefail
source "$(dirname "$0")/common.sh"
SCHEDULE="${SCHEDULE:-zb-h1}"
run_example gpt
