#!/bin/bash
# BERT with PACI: asynchronous 1F1B, stage-local gradient accumulation a, bounded drift
# ceil((N - i) / a). Defaults: BERT-large (24 layers, hidden 1024, sequence 512) on one 8-GPU
# node, one stage per GPU, a = 8, masked LM + sentence order. Without a GPU it falls back to a
# tiny 4-stage BERT on CPU (about a minute). Mock masked-LM data unless DATA_PATH is set:
#   DATA_PATH=data/pydoc_text_sentence VOCAB_FILE=tok/vocab.txt bash examples/pretrain_bert_paci.sh
# (preprocess with tools/preprocess_data.py --split-sentences --tokenizer-type BertWordPieceLowerCase).
# Every value can be overridden from the environment, e.g. PP=4 NO_BINARY_HEAD=1 bash ...
set -euo pipefail
source "$(dirname "$0")/common.sh"

SCHEDULE="${SCHEDULE:-paci}"
if [[ "$ON_GPU" == "1" ]]; then
    PP="${PP:-$NUM_GPUS}"
    NUM_LAYERS="${NUM_LAYERS:-24}"; HIDDEN="${HIDDEN:-1024}"; HEADS="${HEADS:-16}"
    SEQ="${SEQ:-512}"; VOCAB="${VOCAB:-30592}"; MBS="${MBS:-8}"
    MICRO_BATCHES="${MICRO_BATCHES:-8}"          # a: micro-batches per local update
    TRAIN_ITERS="${TRAIN_ITERS:-500}"; LR="${LR:-1e-4}"; DROPOUT="${DROPOUT:-0.1}"
    PRECISION=(--bf16)
else
    echo "No GPU found: running the small CPU configuration." >&2
    PP="${PP:-4}"
    NUM_LAYERS="${NUM_LAYERS:-4}"; HIDDEN="${HIDDEN:-64}"; HEADS="${HEADS:-4}"
    SEQ="${SEQ:-64}"; VOCAB="${VOCAB:-128}"; MBS="${MBS:-4}"
    MICRO_BATCHES="${MICRO_BATCHES:-4}"
    TRAIN_ITERS="${TRAIN_ITERS:-100}"; LR="${LR:-3e-3}"; DROPOUT="${DROPOUT:-0.0}"
    PRECISION=(--num-threads 1)
fi
DP="${DP:-1}"
NPROC=$((PP * DP))

MODEL_ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" --vocab-size "$VOCAB"
    --hidden-dropout "$DROPOUT" --attention-dropout "$DROPOUT"
)
if [[ "${NO_BINARY_HEAD:-0}" == "1" ]]; then MODEL_ARGS+=(--bert-no-binary-head); fi
set_training_args
PARALLEL_ARGS=(--pipeline-model-parallel-size "$PP" --pipeline-schedule "$SCHEDULE")
if [[ -n "${DATA_PATH:-}" ]]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --split "${SPLIT:-949,50,1}"
               --tokenizer-type BertWordPieceLowerCase --vocab-file "${VOCAB_FILE:?set VOCAB_FILE to the WordPiece vocab.txt}")
else
    DATA_ARGS=(--mock-data)
fi
LOGGING_ARGS=(
    --log-interval "${LOG_INTERVAL:-10}" --log-weight-version-drift
    --log-json "${LOG_JSON:-runs/bert_${SCHEDULE}/log.jsonl}"
)

run_pretrain pretrain_bert.py "$NPROC" \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}"
