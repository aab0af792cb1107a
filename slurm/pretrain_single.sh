#!/usr/bin/env bash
# Pre-train on one GPU. Submit from the repository root:
#   AAM_TABLE=/shared/study/table.biom AAM_MATRIX=/shared/study/unifrac.h5 AAM_OUT=/shared/runs/pre1 \
#     sbatch slurm/pretrain_single.sh
# (AAM_TREE=tree.nwk instead of AAM_MATRIX computes the UniFrac matrix in the job.) Inputs are
# staged to node-local scratch; checkpoints and logs go to AAM_OUT on the shared filesystem, so
# a requeued job resumes on any node. Settings: slurm/README.md.
#SBATCH --job-name=aam-pretrain
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=8
#SBATCH --gpus-per-node=1
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=aam-pretrain-%j.out
# ROCm (an MI300A node): AAM_BACKEND=rocm; load the site's module first, e.g. `module load rocm`.
set -euo pipefail
source "${AAM_SLURM_DIR:-${SLURM_SUBMIT_DIR:-.}/slurm}/common.sh"
aam_pretrain 0
