#!/usr/bin/env bash
# Predict a table's samples with a trained checkpoint; writes a TSV. Submit from the repository root:
#   AAM_MODEL=/shared/runs/age1/checkpoints/best.safetensors AAM_TABLE=/shared/new/table.biom \
#     AAM_OUTPUT=/shared/new/age_predictions.tsv sbatch slurm/predict.sh
# Settings: slurm/README.md. (The TSV is written next to its final name and renamed at the end.)
#SBATCH --job-name=aam-predict
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=8
#SBATCH --gpus-per-node=1
#SBATCH --time=02:00:00
#SBATCH --output=aam-predict-%j.out
set -euo pipefail
source "${AAM_SLURM_DIR:-${SLURM_SUBMIT_DIR:-.}/slurm}/common.sh"
aam_require AAM_MODEL AAM_TABLE AAM_OUTPUT
aam_init
model=$(aam_stage "$AAM_MODEL")
table=$(aam_stage "$AAM_TABLE")
aam_gate
# shellcheck disable=SC2086
aam_run predict --backend "$AAM_BACKEND" --model "$model" --table "$table" --output "$AAM_OUTPUT" \
  ${AAM_ARGS:-}
