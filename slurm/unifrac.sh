#!/usr/bin/env bash
# A UniFrac distance matrix from a table and a tree, on the CPUs of one node (no GPU, no ssu).
# Submit from the repository root:
#   AAM_TABLE=/shared/study/table.biom AAM_TREE=/shared/study/tree.nwk \
#     AAM_OUTPUT=/shared/study/unifrac.unweighted.h5 sbatch slurm/unifrac.sh
# AAM_METHOD: unweighted (default), weighted_normalized, weighted_unnormalized, generalized,
# faith_pd. Settings: slurm/README.md.
#SBATCH --job-name=aam-unifrac
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=32
#SBATCH --time=04:00:00
#SBATCH --output=aam-unifrac-%j.out
set -euo pipefail
source "${AAM_SLURM_DIR:-${SLURM_SUBMIT_DIR:-.}/slurm}/common.sh"
aam_require AAM_TABLE AAM_TREE AAM_OUTPUT
aam_init
table=$(aam_stage "$AAM_TABLE")
tree=$(aam_stage "$AAM_TREE")
# shellcheck disable=SC2086
aam_run unifrac --table "$table" --tree "$tree" --method "${AAM_METHOD:-unweighted}" \
  --threads "${SLURM_CPUS_PER_TASK:-$(nproc)}" --output "$AAM_OUTPUT" ${AAM_ARGS:-}
