#!/bin/bash
# BERT with PACI: asynchronous 1F1B with stage-local gradient accumulation a = MICRO_BATCHES,
# bounded drift ceil((N - 1 - s) / a) on stage s, 1F1B's activation memory.
# Real data: DATA_PATH=data/pydoc_text_sentence VOCAB_FILE=tok/wordpiece-vocab.txt (tools/preprocess_data.py --split-sentences).
# An 8-GPU node by default, a tiny model on CPU without a GPU; overrides: examples/common.sh.
set -euo pipefail
source "$(dirname "$0")/common.sh"
SCHEDULE="${SCHEDULE:-paci}"
run_example bert
