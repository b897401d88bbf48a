#!/bin/bash
# BERT with PipeMare: asynchronous, no stashing, T1 learning-rate rescheduling
# (PIPEMARE_ANNEAL_ITERS), T2 discrepancy correction (PIPEMARE_DECAY) and optional synchronous
# warm-up (PIPEMARE_SYNC_WARMUP_ITERS).
# An 8-GPU node by default, a tiny model on CPU without a GPU; overrides: examples/common.sh.
set -euo pipefail
source "$(dirname "$0")/common.sh"
SCHEDULE="${SCHEDULE:-pipemare}"
run_example bert
