#!/bin/bash
# PACI: asynchronous 1F1B with stage-local gradient accumulation a, bounded drift
# ceil((N - i) / a). Defaults: GPT-2 medium on one 8-GPU node, 8 pipeline stages, a = 8.
# Without a GPU it falls back to a tiny 4-stage GPT on CPU that runs in about a minute.
# Every value can be overridden from the environment, e.g.
#   PP=4 MICRO_BATCHES=16 TRAIN_ITERS=2000 bash examples/pretrain_gpt_paci.sh
set -euo pipefail
source "$(dirname "$0")/common.sh"

SCHEDULE="${SCHEDULE:-paci}"
if [[ "$ON_GPU" == "1" ]]; then
    PP="${PP:-$NUM_GPUS}"
    NUM_LAYERS="${NUM_LAYERS:-24}"; HIDDEN="${HIDDEN:-1024}"; HEADS="${HEADS:-16}"
    SEQ="${SEQ:-1024}"; VOCAB="${VOCAB:-50304}"; MBS="${MBS:-4}"
    MICRO_BATCHES="${MICRO_BATCHES:-8}"          # a: micro-batches per local update
    TRAIN_ITERS="${TRAIN_ITERS:-500}"; LR="${LR:-3e-4}"; DROPOUT="${DROPOUT:-0.1}"
    PRECISION=(--bf16)
    NPROC="$PP"
else
    echo "No GPU found: running the small CPU configuration." >&2
    PP="${PP:-4}"
    NUM_LAYERS="${NUM_LAYERS:-4}"; HIDDEN="${HIDDEN:-64}"; HEADS="${HEADS:-4}"
    SEQ="${SEQ:-64}"; VOCAB="${VOCAB:-128}"; MBS="${MBS:-4}"
    MICRO_BATCHES="${MICRO_BATCHES:-4}"
    TRAIN_ITERS="${TRAIN_ITERS:-100}"; LR="${LR:-3e-3}"; DROPOUT="${DROPOUT:-0.0}"
    PRECISION=(--num-threads 1)
    NPROC="$PP"
fi
DP="${DP:-1}"
NPROC=$((NPROC * DP))

MODEL_ARGS=(
    --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" --vocab-size "$VOCAB"
    --hidden-dropout "$DROPOUT" --attention-dropout "$DROPOUT"
)
set_training_args
PARALLEL_ARGS=(
    --pipeline-model-parallel-size "$PP" --pipeline-schedule "$SCHEDULE"
)
DATA_ARGS=(--mock-data)
LOGGING_ARGS=(
    --log-interval "${LOG_INTERVAL:-10}" --log-weight-version-drift
    --log-json "${LOG_JSON:-runs/gpt_${SCHEDULE}/log.jsonl}"
)

run_pretrain pretrain_gpt.py "$NPROC" \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${LOGGING_ARGS[@]}"
