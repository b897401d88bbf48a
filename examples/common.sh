#!/bin/bash
# Shared launcher logic for examples/pretrain_*.sh: GPU/CPU detection, torchrun arguments.
# Source it, fill the *_ARGS arrays, then call `run_pretrain SCRIPT`.
#
# Environment overrides (all optional):
#   NNODES NODE_RANK MASTER_ADDR MASTER_PORT GPUS_PER_NODE  torchrun topology
#   FORCE_CPU=1                                             use the CPU fallback even with GPUs
#   EXTRA_ARGS="..."                                        appended to the trainer's flags

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

detect_gpus() {
    if [[ "${FORCE_CPU:-0}" == "1" ]]; then echo 0; return; fi
    python - <<'PY' 2>/dev/null || echo 0
import torch
print(torch.cuda.device_count() if torch.cuda.is_available() else 0)
PY
}

NUM_GPUS="${GPUS_PER_NODE:-$(detect_gpus)}"
if [[ "$NUM_GPUS" -gt 0 ]]; then ON_GPU=1; else ON_GPU=0; fi

run_pretrain() {
    local script="$1"; shift
    local nproc="$1"; shift
    local -a dist_args=(
        --nproc-per-node "$nproc"
        --nnodes "${NNODES:-1}"
        --node-rank "${NODE_RANK:-0}"
        --master-addr "${MASTER_ADDR:-127.0.0.1}"
        --master-port "${MASTER_PORT:-29500}"
    )
    # shellcheck disable=SC2086
    set -x
    torchrun "${dist_args[@]}" "$REPO_DIR/$script" "$@" ${EXTRA_ARGS:-}
    { set +x; } 2>/dev/null
}

# Megatron's optimizer and schedule flags for the example scripts, into TRAINING_ARGS:
# AdamW(0.9, 0.95), weight decay 0.1, clip 1.0, cosine decay to LR / 10 after 1% warm-up.
# Reads MBS MICRO_BATCHES DP TRAIN_ITERS LR SEED and the PRECISION array.
set_training_args() {
    TRAINING_ARGS=(
        --micro-batch-size "$MBS" --global-batch-size $((MBS * MICRO_BATCHES * DP))
        --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$(python -c "print($LR / 10)")"
        --lr-warmup-iters $((TRAIN_ITERS / 100 + 1)) --lr-decay-style cosine
        --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --seed "${SEED:-1234}"
        "${PRECISION[@]}"
    )
}
