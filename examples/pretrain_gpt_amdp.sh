#!/bin/bash
# GPT with AMDP: D/2 replicated pipelines over D devices in alternating directions, injection
# limit 2, windowed updates (drift <= 1); uses all GPUs of all nodes as pipeline stages (DP = 1),
# MICRO_BATCHES a multiple of the stage count.
# Runs on one 8-GPU node by default (one stage per GPU, bf16), or a tiny 4-stage model on CPU
# without a GPU; every size and flag is an environment override (see examples/common.sh), e.g.
#   TRAIN_ITERS=2000 CHECKPOINT_DIR=ckpt bash examples/pretrain_gpt_amdp.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"

SCHEDULE="${SCHEDULE:-amdp}"
run_example gpt
