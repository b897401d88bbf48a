#!/bin/bash
# GPT with PipeDream-2BW: double-buffered weights, one update per MICRO_BATCHES micro-batches,
# each backward uses the weight version its forward used (1-stale updates); needs m >= N - 1.
# Runs on one 8-GPU node by default (one stage per GPU, bf16), or a tiny 4-stage model on CPU
# without a GPU; every size and flag is an environment override (see examples/common.sh), e.g.
#   TRAIN_ITERS=2000 CHECKPOINT_DIR=ckpt bash examples/pretrain_gpt_2bw.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"

SCHEDULE="${SCHEDULE:-pipedream-2bw}"
run_example gpt
