#!/bin/bash
# BERT with Megatron's interleaved 1F1B: v model chunks per stage (LAYERS_PER_VIRTUAL_STAGE layers
# each, default 1): bubble (N-1)/(v m + N-1) with v chunks; m a multiple of the stage count.
# Runs on one 8-GPU node by default (one stage per GPU, bf16), or a tiny 4-stage model on CPU
# without a GPU; every size and flag is an environment override (see examples/common.sh), e.g.
#   TRAIN_ITERS=2000 CHECKPOINT_DIR=ckpt bash examples/pretrain_bert_interleaved.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"

SCHEDULE="${SCHEDULE:-interleaved-1f1b}"
run_example bert
