#!/bin/bash
# BERT with PACI: asynchronous 1F1B with stage-local gradient accumulation a = MICRO_BATCHES,
# bounded drift ceil((N - 1 - s) / a) on stage s, 1F1B's activation memory.
# Real data: DATA_PATH=data/pydoc_text_document VOCAB_FILE=tok/vocab.json MERGE_FILE=tok/merges.txt (GPT),
# DATA_PATH=data/pydoc_text_sentence VOCAB_FILE=tok/vocab.txt (BERT; --split-sentences data).
# Runs on one 8-GPU node by default (one stage per GPU, bf16), or a tiny 4-stage model on CPU
# without a GPU; every size and flag is an environment override (see examples/common.sh), e.g.
#   TRAIN_ITERS=2000 CHECKPOINT_DIR=ckpt bash examples/pretrain_bert_paci.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"

SCHEDULE="${SCHEDULE:-paci}"
run_example bert
