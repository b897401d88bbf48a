#!/bin/bash
# One task of examples/slurm/pretrain.sbatch, started by srun: with LAUNCHER=torchrun one task per
# node, whose node rank is SLURM_NODEID (SLURM_PROCID with one task per node); with LAUNCHER=srun
# one task per GPU, which becomes a rank itself (the trainer reads SLURM_PROCID/LOCALID/NTASKS).
# The rest comes from the environment the batch script exported (NNODES MASTER_ADDR EXAMPLE ...).
set -euo pipefail
export NODE_RANK="${SLURM_NODEID:-${SLURM_PROCID:?not started by srun}}"
exec bash "${EXAMPLE:?set by the batch script}"
