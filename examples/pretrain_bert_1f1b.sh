#!/bin/bash
# BERT with Megatron's 1F1B and a pipeline flush: bubble (N-1)/(m+N-1), no weight drift.
# Runs on one 8-GPU node by default (one stage per GPU, bf16), or a tiny 4-stage model on CPU
# without a GPU; every size and flag is an environment override (see examples/common.sh), e.g.
#   TRAIN_ITERS=2000 CHECKPOINT_DIR=ckpt bash examples/pretrain_bert_1f1b.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"

SCHEDULE="${SCHEDULE:-1f1b}"
run_example bert
