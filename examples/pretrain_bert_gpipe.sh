#!/bin/bash
# BERT with GPipe: all forwards, then all backwards, then a synchronous step: 1F1B's bubble
# (N-1)/(m+N-1) with activations of all m micro-batches on every stage (a reference point).
# An 8-GPU node by default, a tiny model on CPU without a GPU; overrides: examples/common.sh.
set -euo pipefail
source "$(dirname "$0")/common.sh"
SCHEDULE="${SCHEDULE:-gpipe}"
run_example bert
