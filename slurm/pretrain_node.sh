#!/usr/bin/env bash
# Pre-train on every GPU of one node, data parallel (one process, one model replica per GPU;
# --batch-size stays the global batch). Submit from the repository root:
#   AAM_TABLE=... AAM_MATRIX=... AAM_OUT=/shared/runs/pre4 sbatch slurm/pretrain_node.sh
# Settings as slurm/pretrain_single.sh (slurm/README.md); AAM_DEVICES defaults to `all`. Across
# GPUs use --mixed-precision bf16 (AAM_ARGS): docs/training.md says why and how it scales today.
#SBATCH --job-name=aam-pretrain-node
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=32
#SBATCH --gpus-per-node=4
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=aam-pretrain-node-%j.out
set -euo pipefail
source "${AAM_SLURM_DIR:-${SLURM_SUBMIT_DIR:-.}/slurm}/common.sh"
aam_pretrain all
