#!/bin/bash
# BERT with PipeMare: asynchronous, no stashing, T1 learning-rate rescheduling
# (PIPEMARE_ANNEAL_ITERS), T2 discrepancy correction (PIPEMARE_DECAY) and optional synchronous
# warm-up (PIPEMARE_SYNC_WARMUP_ITERS).
# Runs on one 8-GPU node by default (one stage per GPU, bf16), or a tiny 4-stage model on CPU
# without a GPU; every size and flag is an environment override (see examples/common.sh), e.g.
#   TRAIN_ITERS=2000 CHECKPOINT_DIR=ckpt bash examples/pretrain_bert_pipemare.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"

SCHEDULE="${SCHEDULE:-pipemare}"
run_example bert
