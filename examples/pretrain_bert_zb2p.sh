#!/bin/bash
# BERT with Zero Bubble ZB-2P: B/W split, order searched from F/B/W/comm times profiled in the
# first ZB_PROFILE_ITERS iterations, activation memory up to 2N micro-batches, optimizer
# post-validation instead of a pipeline-wide step (POST_VALIDATION=0 keeps the synchronous step).
# Runs on one 8-GPU node by default (one stage per GPU, bf16), or a tiny 4-stage model on CPU
# without a GPU; every size and flag is an environment override (see examples/common.sh), e.g.
#   TRAIN_ITERS=2000 CHECKPOINT_DIR=ckpt bash examples/pretrain_bert_zb2p.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"

SCHEDULE="${SCHEDULE:-zb-2p}"
run_example bert
