#!/usr/bin/env bash
# Train a predictor of a metadata column on one GPU (the UniFrac matrix, or the tree, is needed
# as in pretraining), from a pre-trained encoder when AAM_PRETRAINED is set. Submit from the
# repository root:
#   AAM_TABLE=... AAM_MATRIX=... AAM_METADATA=/shared/study/map.tsv AAM_COLUMN=age \
#     AAM_PRETRAINED=/shared/runs/pre1/checkpoints/best.safetensors AAM_OUT=/shared/runs/age1 \
#     sbatch slurm/train.sh
# (AAM_ARGS="--classifier" for a categorical column.) Settings: slurm/README.md.
#SBATCH --job-name=aam-train
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=8
#SBATCH --gpus-per-node=1
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=aam-train-%j.out
set -euo pipefail
source "${AAM_SLURM_DIR:-${SLURM_SUBMIT_DIR:-.}/slurm}/common.sh"
aam_require AAM_TABLE AAM_METADATA AAM_COLUMN AAM_OUT
aam_init
table=$(aam_stage "$AAM_TABLE")
metadata=$(aam_stage "$AAM_METADATA")
aam_unifrac_args
encoder=()
if [ -n "${AAM_PRETRAINED:-}" ]; then
  encoder=(--pretrained-encoder "$(aam_stage "$AAM_PRETRAINED")")
fi
aam_gate
# shellcheck disable=SC2086
aam_run train --backend "$AAM_BACKEND" --devices "${AAM_DEVICES:-0}" --table "$table" \
  --metadata "$metadata" --metadata-column "$AAM_COLUMN" "${UNIFRAC_ARGS[@]}" "${encoder[@]}" \
  --output-dir "$AAM_OUT" \
  --checkpoint-every-steps "${AAM_CHECKPOINT_EVERY:-500}" --resume-from auto ${AAM_ARGS:-}
