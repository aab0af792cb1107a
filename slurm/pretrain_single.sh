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
aam_require AAM_TABLE AAM_OUT
aam_init
table=$(aam_stage "$AAM_TABLE")
if [ -n "${AAM_MATRIX:-}" ]; then
  unifrac=(--unifrac-matrix "$(aam_stage "$AAM_MATRIX")")
else
  aam_require AAM_TREE
  unifrac=(--tree "$(aam_stage "$AAM_TREE")")
fi
aam_gate
# shellcheck disable=SC2086 # AAM_ARGS holds several flags
aam_run pretrain --backend "$AAM_BACKEND" --devices "${AAM_DEVICES:-0}" --table "$table" "${unifrac[@]}" \
  --output-dir "$AAM_OUT" --checkpoint-every-steps "${AAM_CHECKPOINT_EVERY:-500}" --resume-from auto \
  ${AAM_ARGS:-}
