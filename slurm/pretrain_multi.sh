#!/usr/bin/env bash
# Pre-train across several nodes, data parallel: one process per node (srun, one task per node)
# on every GPU of its node; every replica of every node sums through one NCCL communicator
# (CUDA), or through the host and burn-collective (the other backends; docs/training.md). Ranks and the rendezvous come from SLURM's variables (SLURM_PROCID,
# SLURM_NTASKS, the job's first node; the port is 20000 + job ID mod 20000). --batch-size stays
# the global batch: 2 nodes of 4 GPUs and AAM_ARGS="--batch-size 64" train 8 samples per GPU.
# Submit from the repository root:
#   AAM_TABLE=... AAM_MATRIX=... AAM_OUT=/shared/runs/pre8 sbatch --nodes=2 slurm/pretrain_multi.sh
# Settings as slurm/pretrain_single.sh (slurm/README.md); AAM_DEVICES defaults to `all`. The
# time-limit warning reaches every process at once (srun forwards it), and all stop at the same
# step with one checkpoint (process 0 writes it); the requeued job resumes from it.
#SBATCH --job-name=aam-pretrain-multi
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=32
#SBATCH --gpus-per-node=4
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=aam-pretrain-multi-%j.out
set -euo pipefail
source "${AAM_SLURM_DIR:-${SLURM_SUBMIT_DIR:-.}/slurm}/common.sh"
aam_pretrain_multi all
