#!/bin/bash
# GPT with asynchronous 1F1B (PipeDream without weight stashing): no flush, one stage-local
# update per micro-batch (MICRO_BATCHES=1), drift up to N-1-s versions on stage s.
# Runs on one 8-GPU node by default (one stage per GPU, bf16), or a tiny 4-stage model on CPU
# without a GPU; every size and flag is an environment override (see examples/common.sh), e.g.
#   TRAIN_ITERS=2000 CHECKPOINT_DIR=ckpt bash examples/pretrain_gpt_async.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"

SCHEDULE="${SCHEDULE:-async-1f1b}"
run_example gpt
