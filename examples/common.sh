#!/bin/bash
# Shared launcher for examples/pretrain_{gpt,bert}_<schedule>.sh and examples/slurm/*.sbatch.
#
# An example script sources this file, sets SCHEDULE (its --pipeline-schedule) and calls
# `run_example gpt` or `run_example bert`; the schedule's own flags and constraints live here
# (schedule_presets, schedule_flags), so any example runs any schedule: SCHEDULE=zb-2p bash ...
#
# Defaults: on GPUs a GPT-2 medium / BERT-large sized model in bf16, one pipeline stage per GPU
# of the node (DP = number of nodes); without a GPU a tiny 4-stage model on CPU.
#
# Environment overrides (all optional):
#   model, batch    PP DP NUM_LAYERS HIDDEN HEADS SEQ VOCAB MBS MICRO_BATCHES TRAIN_ITERS LR SEED DROPOUT
#   schedule        SCHEDULE, and its own knobs (see schedule_flags below: LAYERS_PER_VIRTUAL_STAGE,
#                   ZB_PROFILE_ITERS, ZB_MEMORY_LIMIT, POST_VALIDATION, PIPEMARE_*); BERT: NO_BINARY_HEAD=1
#   data            DATA_PATH ("PREFIX" or "W1 P1 W2 P2") SPLIT TOKENIZER_TYPE VOCAB_FILE MERGE_FILE
#                   TOKENIZER_MODEL (without DATA_PATH: mock data)
#   checkpoints     CHECKPOINT_DIR (-> --save DIR --load DIR: a rerun or a requeued job resumes,
#                   an empty DIR starts fresh) SAVE_INTERVAL
#   evaluation      EVAL_INTERVAL EVAL_ITERS
#   logging         LOG_INTERVAL LOG_JSON TENSORBOARD_DIR
#   launch          NNODES NODE_RANK MASTER_ADDR MASTER_PORT GPUS_PER_NODE RDZV_BACKEND RDZV_ID
#                   LAUNCHER=srun      this process is one rank of an srun step (one task per GPU):
#                                      run python directly, no torchrun (the trainer reads SLURM_*)
#                   EXIT_SIGNAL=SIGUSR1  with CHECKPOINT_DIR: --exit-signal-handler --exit-signal SIG
#                                      (that signal saves a checkpoint and exits 0)
#                   EXIT_CHECK_INTERVAL=N  --exit-check-interval N: an asynchronous schedule stops only
#                                      where it drains (SAVE_INTERVAL, or every N iterations); keep
#                                      N iterations under the Slurm signal's 120 s lead
#                   MAX_RESTARTS=N     torchrun --max-restarts N: a failed or hung rank restarts every rank
#                                      of the job in place, resuming from CHECKPOINT_DIR (default 0)
#                   MAX_REQUEUES=N     Slurm scripts: a failed step requeues the job (#SBATCH --requeue)
#                                      while SLURM_RESTART_COUNT < N; it resumes from CHECKPOINT_DIR (default 0)
#                   FORCE_CPU=1        the CPU fallback even with GPUs
#                   EXECUTOR=emulator  all stages in one python process, no torchrun (DP = 1)
#                   DRY_RUN=1          print the command line (one line, shell-quoted) and exit
#                   EXTRA_ARGS="..."   appended to the trainer's flags

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

detect_gpus() {
    if [[ "${FORCE_CPU:-0}" == "1" ]]; then echo 0; return; fi
    python - <<'PY' 2>/dev/null || echo 0
import torch
print(torch.cuda.device_count() if torch.cuda.is_available() else 0)
PY
}

if [[ "${FORCE_CPU:-0}" == "1" ]]; then NUM_GPUS=0; else NUM_GPUS="${GPUS_PER_NODE:-$(detect_gpus)}"; fi
if [[ "$NUM_GPUS" -gt 0 ]]; then ON_GPU=1; else ON_GPU=0; fi
NNODES="${NNODES:-1}"

# The default pipeline depth: one stage per GPU of the node, 4 stages on CPU.
default_pp() { if [[ "$ON_GPU" == "1" ]]; then echo "$NUM_GPUS"; else echo 4; fi; }

# Model and batch defaults for MODEL (gpt | bert); every value keeps an existing setting.
model_defaults() {
    local model="$1"
    PP="${PP:-$(default_pp)}"
    if [[ "$ON_GPU" == "1" ]]; then
        NUM_LAYERS="${NUM_LAYERS:-24}"; HIDDEN="${HIDDEN:-1024}"; HEADS="${HEADS:-16}"
        MICRO_BATCHES="${MICRO_BATCHES:-8}"          # per replica and update (PACI's a)
        TRAIN_ITERS="${TRAIN_ITERS:-500}"; DROPOUT="${DROPOUT:-0.1}"
        if [[ "$model" == "bert" ]]; then
            SEQ="${SEQ:-512}"; VOCAB="${VOCAB:-30592}"; MBS="${MBS:-8}"; LR="${LR:-1e-4}"
        else
            SEQ="${SEQ:-1024}"; VOCAB="${VOCAB:-50304}"; MBS="${MBS:-4}"; LR="${LR:-3e-4}"
        fi
        PRECISION=(--bf16)
    else
        echo "No GPU found: running the small CPU configuration." >&2
        NUM_LAYERS="${NUM_LAYERS:-4}"; HIDDEN="${HIDDEN:-64}"; HEADS="${HEADS:-4}"
        SEQ="${SEQ:-64}"; VOCAB="${VOCAB:-128}"; MBS="${MBS:-4}"
        MICRO_BATCHES="${MICRO_BATCHES:-4}"
        TRAIN_ITERS="${TRAIN_ITERS:-100}"; LR="${LR:-3e-3}"; DROPOUT="${DROPOUT:-0.0}"
        PRECISION=(--num-threads 1)
    fi
    if [[ "${EXECUTOR:-distributed}" == "emulator" ]]; then DP="${DP:-1}"; else DP="${DP:-$NNODES}"; fi
}

# Megatron's optimizer and schedule flags, into TRAINING_ARGS: AdamW(0.9, 0.95), weight decay
# 0.1, clip 1.0, cosine decay to LR / 10 after 1% warm-up.
set_training_args() {
    TRAINING_ARGS=(
        --micro-batch-size "$MBS" --global-batch-size $((MBS * MICRO_BATCHES * DP))
        --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr "$(awk -v lr="$LR" 'BEGIN { print lr / 10 }')"
        --lr-warmup-iters $((TRAIN_ITERS / 100 + 1)) --lr-decay-style cosine
        --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --seed "${SEED:-1234}"
        "${PRECISION[@]}"
    )
}

# --data-path and tokenizer flags for MODEL, or --mock-data, into DATA_ARGS.
set_data_args() {
    local model="$1"
    if [[ -z "${DATA_PATH:-}" ]]; then DATA_ARGS=(--mock-data); return; fi
    local -a paths
    read -r -a paths <<< "$DATA_PATH"
    local tokenizer=GPT2BPETokenizer
    if [[ "$model" == "bert" ]]; then tokenizer=BertWordPieceLowerCase; fi
    DATA_ARGS=(--data-path "${paths[@]}" --split "${SPLIT:-949,50,1}" --tokenizer-type "${TOKENIZER_TYPE:-$tokenizer}")
    if [[ -n "${VOCAB_FILE:-}" ]]; then DATA_ARGS+=(--vocab-file "$VOCAB_FILE"); fi
    if [[ -n "${MERGE_FILE:-}" ]]; then DATA_ARGS+=(--merge-file "$MERGE_FILE"); fi
    if [[ -n "${TOKENIZER_MODEL:-}" ]]; then DATA_ARGS+=(--tokenizer-model "$TOKENIZER_MODEL"); fi
}

# Checkpoints, evaluation, logging and TensorBoard flags, into RUN_ARGS.
set_run_args() {
    local model="$1"
    RUN_ARGS=(
        --log-interval "${LOG_INTERVAL:-10}" --log-weight-version-drift
        --log-json "${LOG_JSON:-runs/${model}_${SCHEDULE}/log.jsonl}"
    )
    if [[ -n "${CHECKPOINT_DIR:-}" ]]; then
        RUN_ARGS+=(--save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval "${SAVE_INTERVAL:-100}")
        if [[ -n "${EXIT_SIGNAL:-}" ]]; then RUN_ARGS+=(--exit-signal-handler --exit-signal "$EXIT_SIGNAL"); fi
        if [[ -n "${EXIT_CHECK_INTERVAL:-}" ]]; then RUN_ARGS+=(--exit-check-interval "$EXIT_CHECK_INTERVAL"); fi
    fi
    if [[ -n "${EVAL_INTERVAL:-}" ]]; then
        RUN_ARGS+=(--eval-interval "$EVAL_INTERVAL" --eval-iters "${EVAL_ITERS:-10}")
    fi
    if [[ -n "${TENSORBOARD_DIR:-}" ]]; then RUN_ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR"); fi
}

# Run (or with DRY_RUN=1 print) SCRIPT with the given trainer flags: torchrun with this node's
# share of PP x DP ranks, one python process with EXECUTOR=emulator, or this task's rank with
# LAUNCHER=srun. With LAUNCH_EXEC=1 (the Slurm scripts) the command replaces this shell, so
# signals from Slurm reach torchrun or the rank itself, not a shell that would die of them.
launch() {
    local script="$1"; shift
    local -a extra cmd
    read -r -a extra <<< "${EXTRA_ARGS:-}"
    if [[ "${EXECUTOR:-distributed}" == "emulator" ]]; then
        cmd=(python "$REPO_DIR/$script" --pipeline-executor emulator "$@" "${extra[@]}")
    elif [[ "${LAUNCHER:-torchrun}" == "srun" ]]; then
        if [[ -n "${SLURM_NTASKS:-}" ]] && (( PP * DP != SLURM_NTASKS )); then
            echo "error: PP=$PP x DP=$DP = $((PP * DP)) ranks, but the srun step has SLURM_NTASKS=$SLURM_NTASKS tasks" >&2
            return 2
        fi
        cmd=(python "$REPO_DIR/$script" "$@" "${extra[@]}")
    else
        local ranks=$((PP * DP))
        if (( ranks % NNODES )); then
            echo "error: PP=$PP x DP=$DP = $ranks ranks do not split over NNODES=$NNODES nodes" >&2
            return 2
        fi
        local nproc=$((ranks / NNODES))
        if [[ "$ON_GPU" == "1" ]] && (( nproc > NUM_GPUS )); then
            echo "error: PP=$PP x DP=$DP needs $nproc ranks per node, the node has $NUM_GPUS GPUs" >&2
            return 2
        fi
        local endpoint="${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-29500}"
        cmd=(torchrun --nproc-per-node "$nproc" --nnodes "$NNODES" --node-rank "${NODE_RANK:-0}"
             --max-restarts "${MAX_RESTARTS:-0}"
             --rdzv-backend "${RDZV_BACKEND:-static}" --rdzv-endpoint "$endpoint"
             --rdzv-id "${RDZV_ID:-megatron-async}"
             "$REPO_DIR/$script" "$@" "${extra[@]}")
    fi
    if [[ "${DRY_RUN:-0}" == "1" ]]; then
        printf '%q ' "${cmd[@]}"; echo
        return 0
    fi
    echo "+ ${cmd[*]}" >&2
    if [[ "${LAUNCH_EXEC:-0}" == "1" ]]; then exec "${cmd[@]}"; fi
    "${cmd[@]}"
}

# Schedule-specific defaults that the model defaults depend on (before model_defaults).
schedule_presets() {
    case "$SCHEDULE" in
        async-1f1b) MICRO_BATCHES="${MICRO_BATCHES:-1}" ;;     # one update per micro-batch
        interleaved-1f1b) if [[ "$ON_GPU" == "0" ]]; then NUM_LAYERS="${NUM_LAYERS:-8}"; fi ;;  # 2 chunks per stage
        zb-h2)  # its bubble vanishes once m >= 2N - 1 (stage 0 warms up with 2N - 1 forwards): m = 2N
            PP="${PP:-$(default_pp)}"; MICRO_BATCHES="${MICRO_BATCHES:-$((2 * PP))}" ;;
        zb-v|v-half|v-min|dualpipev)  # V placement: 2N model parts; DualPipeV needs m >= 2N
            PP="${PP:-$(default_pp)}"; MICRO_BATCHES="${MICRO_BATCHES:-$((2 * PP))}"
            if [[ "$ON_GPU" == "1" ]]; then NUM_LAYERS="${NUM_LAYERS:-$((4 * PP))}"; else NUM_LAYERS="${NUM_LAYERS:-$((2 * PP))}"; fi ;;
        amdp)  # D/2 replicated pipelines are its data parallelism: all GPUs of all nodes, DP = 1
            DP="${DP:-1}"
            if [[ "$ON_GPU" == "1" ]]; then PP="${PP:-$((NUM_GPUS * NNODES))}"; MICRO_BATCHES="${MICRO_BATCHES:-$PP}"; fi ;;
    esac
}

# Schedule-specific flags, into SCHEDULE_ARGS (after model_defaults: may read PP, TRAIN_ITERS).
#   interleaved-1f1b  LAYERS_PER_VIRTUAL_STAGE (1)
#   zb-1p, zb-2p      ZB_PROFILE_ITERS (2), ZB_MEMORY_LIMIT, POST_VALIDATION (1: the paper's optimizer post-validation)
#   zb-h2             POST_VALIDATION (1: keeps its parallelogram across iterations, the paper's setting)
#   pipemare          PIPEMARE_ANNEAL_ITERS (5 x LR warm-up, the paper's Transformer rule), PIPEMARE_DECAY (0.2),
#                     PIPEMARE_SYNC_WARMUP_ITERS (0), PIPEMARE_DELAY_MODEL (stream: this 1F1B stream's real
#                     delay ceil((N-1-s)/a); paper: Table 1's fine-grained formula, about twice as long here)
schedule_flags() {
    SCHEDULE_ARGS=()
    case "$SCHEDULE" in
        interleaved-1f1b)
            SCHEDULE_ARGS=(--num-layers-per-virtual-pipeline-stage "${LAYERS_PER_VIRTUAL_STAGE:-1}") ;;
        zb-1p|zb-2p)
            SCHEDULE_ARGS=(--zb-profile-iters "${ZB_PROFILE_ITERS:-2}")
            if [[ -n "${ZB_MEMORY_LIMIT:-}" ]]; then SCHEDULE_ARGS+=(--zb-memory-limit "$ZB_MEMORY_LIMIT"); fi
            post_validation_flag ;;
        zb-h2) post_validation_flag ;;
        pipemare)
            SCHEDULE_ARGS=(
                --pipemare-lr-anneal-iters "${PIPEMARE_ANNEAL_ITERS:-$((5 * (TRAIN_ITERS / 100 + 1)))}"
                --pipemare-discrepancy-decay "${PIPEMARE_DECAY:-0.2}"
                --pipemare-sync-warmup-iters "${PIPEMARE_SYNC_WARMUP_ITERS:-0}"
                --pipemare-delay-model "${PIPEMARE_DELAY_MODEL:-stream}"
            ) ;;
    esac
}

# --enable-optimizer-post-validation into SCHEDULE_ARGS unless POST_VALIDATION=0. (untied: post-validation has no synchronous step to sum tied embeddings at)
post_validation_flag() {
    if [[ "${POST_VALIDATION:-1}" == "1" ]]; then SCHEDULE_ARGS+=(--enable-optimizer-post-validation --untie-embeddings-and-output-weights); fi
}

# The whole example for MODEL (gpt | bert) and SCHEDULE: defaults, flags, launch.
run_example() {
    local model="$1"
    schedule_presets
    model_defaults "$model"
    schedule_flags
    local -a model_args=(
        --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
        --seq-length "$SEQ" --max-position-embeddings "$SEQ" --vocab-size "$VOCAB"
        --hidden-dropout "$DROPOUT" --attention-dropout "$DROPOUT"
    )
    if [[ "$model" == "bert" && "${NO_BINARY_HEAD:-0}" == "1" ]]; then model_args+=(--bert-no-binary-head); fi
    set_training_args
    set_data_args "$model"
    set_run_args "$model"
    launch "pretrain_${model}.py" "${model_args[@]}" "${TRAINING_ARGS[@]}" \
        --pipeline-model-parallel-size "$PP" --pipeline-schedule "$SCHEDULE" "${SCHEDULE_ARGS[@]}" \
        "${DATA_ARGS[@]}" "${RUN_ARGS[@]}"
}

# The example script for MODEL (gpt | bert) and a --pipeline-schedule name: the
# examples/pretrain_MODEL_*.sh whose default is that schedule (its SCHEDULE="${SCHEDULE:-NAME}" line).
example_script() {
    local model="$1" schedule="$2" path
    for path in "$REPO_DIR"/examples/pretrain_"$model"_*.sh; do
        if grep -qxF "SCHEDULE=\"\${SCHEDULE:-$schedule}\"" "$path"; then echo "$path"; return 0; fi
    done
    echo "error: no example script for schedule $schedule (examples/pretrain_${model}_*.sh)" >&2
    return 2
}

# Slurm batch scripts (examples/slurm/): the job's topology, exported for examples/slurm/node.sh
# and the example it runs. NODES (default: the allocation's), GPUS_PER_NODE, MODEL (gpt),
# SCHEDULE (paci), EXAMPLE (default: the example of MODEL and SCHEDULE), CHECKPOINT_DIR
# (default: checkpoints/MODEL_SCHEDULE, so a requeued job resumes), MASTER_PORT, MOCK_DATA=1
# (train on mock data without DATA_PATH; refused otherwise), EXIT_SIGNAL (SIGUSR1: the signal
# #SBATCH --signal=B:USR1@120 sends, passed on to the ranks, which save and exit 0).
# MASTER_ADDR is the first host of `scontrol show hostnames "$SLURM_JOB_NODELIST"`.
slurm_env() {
    cd "$REPO_DIR"
    if [[ -z "${DATA_PATH:-}" && "${MOCK_DATA:-0}" != "1" ]]; then
        echo "error: no DATA_PATH: a cluster job does not train on mock data unless MOCK_DATA=1" >&2
        return 2
    fi
    if [[ -n "${SLURM_GPUS_ON_NODE:-}" ]] && (( GPUS_PER_NODE > SLURM_GPUS_ON_NODE )); then
        echo "error: GPUS_PER_NODE=$GPUS_PER_NODE but the job has $SLURM_GPUS_ON_NODE GPUs per node" \
             "(submit with sbatch --gpus-per-node=$GPUS_PER_NODE)" >&2
        return 2
    fi
    NNODES="${NODES:-${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}}"
    local -a hosts
    mapfile -t hosts < <(scontrol show hostnames "${SLURM_JOB_NODELIST:?not inside a Slurm job}")
    if (( ${#hosts[@]} < NNODES )); then
        echo "error: NODES=$NNODES but the allocation has ${#hosts[@]} host(s): ${hosts[*]}" >&2
        return 2
    fi
    MASTER_ADDR="${hosts[0]}"
    MASTER_PORT="${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}"
    RDZV_ID="${SLURM_JOB_ID:-megatron-async}"
    MODEL="${MODEL:-gpt}"; SCHEDULE="${SCHEDULE:-paci}"
    EXAMPLE="${EXAMPLE:-$(example_script "$MODEL" "$SCHEDULE")}"
    CHECKPOINT_DIR="${CHECKPOINT_DIR:-$REPO_DIR/checkpoints/${MODEL}_${SCHEDULE}}"
    EXIT_SIGNAL="${EXIT_SIGNAL:-SIGUSR1}"
    mkdir -p "$CHECKPOINT_DIR"
    export NNODES MASTER_ADDR MASTER_PORT RDZV_ID MODEL SCHEDULE EXAMPLE CHECKPOINT_DIR GPUS_PER_NODE EXIT_SIGNAL
    export LAUNCH_EXEC=1 LAUNCHER="${LAUNCHER:-torchrun}"
    # torchrun passes EXIT_SIGNAL on to its workers (instead of dying of it) and waits this long for
    # their checkpoint before SIGKILL; keep it below the --signal lead time.
    export TORCHELASTIC_SIGNALS_TO_HANDLE="${TORCHELASTIC_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,$EXIT_SIGNAL}"
    export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-110}"
    # NCCL: a failed or timed-out collective aborts the rank instead of hanging the job; one CUDA
    # connection as Megatron-LM sets it. Site-specific, set them yourself where needed, e.g.
    #   NCCL_SOCKET_IFNAME=ib0 NCCL_IB_HCA=mlx5 NCCL_IB_TIMEOUT=22 NCCL_IB_QPS_PER_CONNECTION=4
    export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
    export NCCL_ASYNC_ERROR_HANDLING="${NCCL_ASYNC_ERROR_HANDLING:-1}"  # its name before torch 2.2
    export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
    # pyxis: CONTAINER_IMAGE (e.g. the docker/ image) and CONTAINER_MOUNTS (SRC:DST[,...]; the
    # repository is mounted at its own path, so the same paths work inside).
    SRUN_CONTAINER_ARGS=()
    if [[ -n "${CONTAINER_IMAGE:-}" ]]; then
        SRUN_CONTAINER_ARGS=(--container-image="$CONTAINER_IMAGE"
                             --container-mounts="$REPO_DIR:$REPO_DIR${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}"
                             --container-workdir="$REPO_DIR")
    fi
    echo "[slurm] job ${SLURM_JOB_ID:-?}: $NNODES node(s) x $GPUS_PER_NODE GPUs, rendezvous $MASTER_ADDR:$MASTER_PORT," \
         "$EXAMPLE (schedule $SCHEDULE, launcher $LAUNCHER), checkpoints $CHECKPOINT_DIR" \
         "${CONTAINER_IMAGE:+, container $CONTAINER_IMAGE}" >&2
}

# Run the job's step "$@" in the background and wait for it. The batch shell's USR1
# (#SBATCH --signal=B:USR1@T, T seconds before the time limit) is passed on to the step, whose
# ranks save a checkpoint and exit; then the job is requeued (REQUEUE=0: not) and resumes from
# CHECKPOINT_DIR. TERM (scancel) is passed on without a requeue. A step that fails by itself (a
# rank killed, a node lost, torchrun's restarts spent) requeues the job while SLURM_RESTART_COUNT
# < MAX_REQUEUES (default 0: the job fails); the requeued job resumes from CHECKPOINT_DIR.
slurm_run_step() {
    local step_pid="" signalled="" rc=0
    trap 'signalled=USR1; if [[ -n "$step_pid" ]]; then kill -USR1 "$step_pid" || true; fi' USR1
    trap 'signalled=${signalled:-TERM}; if [[ -n "$step_pid" ]]; then kill -TERM "$step_pid" || true; fi' TERM
    "$@" &
    step_pid=$!
    if [[ -n "$signalled" ]]; then kill "-$signalled" "$step_pid"; fi  # arrived while starting it
    while :; do
        rc=0; wait "$step_pid" || rc=$?
        if (( rc > 128 )) && kill -0 "$step_pid" 2>/dev/null; then continue; fi  # a trap ran; the step still runs
        break
    done
    trap - USR1 TERM
    if [[ "$signalled" == "USR1" && "${REQUEUE:-1}" == "1" ]]; then
        echo "[slurm] USR1 before the time limit: the step saved and exited ($rc); requeueing job $SLURM_JOB_ID" >&2
        scontrol requeue "$SLURM_JOB_ID"
        return 0
    fi
    local requeues="${SLURM_RESTART_COUNT:-0}"
    if [[ -z "$signalled" ]] && (( rc != 0 && requeues < ${MAX_REQUEUES:-0} )); then
        echo "[slurm] the step failed ($rc): requeueing job $SLURM_JOB_ID (requeue $((requeues + 1)) of" \
             "$MAX_REQUEUES); it resumes from the last checkpoint in ${CHECKPOINT_DIR:-its --load}" >&2
        scontrol requeue "$SLURM_JOB_ID"
        return 0
    fi
    return "$rc"
}
