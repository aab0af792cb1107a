#!/usr/bin/env bash
# Data parallel on one GPU: aam-rs `pretrain` on the full oral2550 at the reference's default
# model and batch (8), once on one device (`--devices 0`) and once as two replicas of 4 samples
# on the same GPU (`--devices 0,0`, UniFrac pairs global), dropout and nucleotide masking off so
# that both runs take the same steps. Compares their epoch losses and their training samples/s:
# the per-step cost of the data-parallel path (threads, the exchange, the gradient sum, a second
# optimiser step) against the plain step, measured in the same call.
#
# Run from the repository root on the GPU machine (docs/gpu-benchmarks.md), with carried:
#   .carry/gpu/aam-rs.xz      CUDARC_CUDA_VERSION=12080 cargo build --profile device -p aam-cli
#                             --features cuda,fusion; xz
#   .carry/oral2550/*.xz      oral_2550.biom and unifrac.unweighted.h5 from ../shared/data, xz'd
#   .carry/gpu/cache/         optional: CubeCL's compiled kernels (benches/kernel_cache.sh)
# Env: EPOCHS (default 2: the first may compile kernels, compare the last), BACKEND (cuda),
#      TRAIN_TIMEOUT (s per run, default 300), STOCHASTIC=1 (keep dropout and masking on: the two
#      runs then draw differently, and their loss curves should agree within noise; every
#      step's losses are logged, benches/loss_curves.py plots them).
# Writes to $OUT: one.log, two.log, one.csv, two.csv (metrics.csv of each run), cache.txz.*.
set -uo pipefail
EPOCHS=${EPOCHS:-2}; BACKEND=${BACKEND:-cuda}
if [ "${STOCHASTIC:-0}" = 1 ]; then DETERMINISTIC=; LOG=info,aam_train=debug
else DETERMINISTIC="--dropout 0 --nuc-mask-ratio 0"; LOG=info; fi
source tests/oral2550_carry.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for run in one:0 two:0,0; do
  name=${run%%:*}; devices=${run#*:}
  start=$(date +%s)
  AAM_LOG=$LOG timeout "${TRAIN_TIMEOUT:-300}" /tmp/bin/aam-rs pretrain --backend "$BACKEND" \
    --table .carry/oral2550/oral_2550.biom --unifrac-matrix .carry/oral2550/unifrac.unweighted.h5 \
    --rarefy-depth 1000 --epochs "$EPOCHS" --warmup-steps 100 --num-workers 8 \
    $DETERMINISTIC --devices "$devices" \
    --output-dir "/tmp/run_$name" > "$OUT/$name.log" 2>&1
  echo "$name (--devices $devices): rc=$? wall=$(( $(date +%s) - start ))s"
  cp "/tmp/run_$name/metrics.csv" "$OUT/$name.csv" 2>/dev/null
  grep -E "data parallel|epoch [0-9]+/" "$OUT/$name.log" | sed 's/^.*INFO //' | cut -c1-400
done
