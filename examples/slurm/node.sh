#!/bin/bash
# One node's part of examples/slurm/pretrain.sbatch, started by srun (one task per node): the
# node rank is SLURM_NODEID (SLURM_PROCID with one task per node), the rest comes from the
# environment the batch script exported (NNODES MASTER_ADDR MASTER_PORT EXAMPLE ...).
set -euo pipefail
export NODE_RANK="${SLURM_NODEID:-${SLURM_PROCID:?not started by srun}}"
exec bash "${EXAMPLE:?set by the batch script}"
