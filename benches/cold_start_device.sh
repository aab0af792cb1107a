#!/usr/bin/env bash
# The first epoch on a fresh node, per build: `aam-rs pretrain` on the full oral2550 (the
# reference's default model, batch 8, rarefied to 1,000) for EPOCHS epochs, each build from an
# empty kernel cache, with CubeCL's compilation log on, so that the kernels a cold epoch
# compiles are counted beside its time. Builds run in turn in one call (a same-call A/B).
#
# Run from the repository root on the GPU machine (docs/gpu-benchmarks.md), with carry
# [".carry/gpu", ".carry/oral2550"]:
#   .carry/gpu/<bin>.xz   for each of BINS: CUDARC_CUDA_VERSION=12080 cargo build --profile device
#                         -p aam-cli --features cuda,fusion; xz
#   .carry/oral2550/*.xz  as benches/pretrain_device.sh (tests/oral2550_carry.sh)
# Env: BINS (default aam-rs), EPOCHS (default 2: the cold epoch, then a warm one),
#      TRAIN_TIMEOUT (s per build, default 300), TRAIN_ARGS (extra flags; `--time-phases host`
#      logs the first step, timed in training.log from the model's line).
# Writes to $OUT: pretrain_<bin>.log, compile_<bin>.log (CubeCL's, one line per compiled
# kernel), and prints per build the epochs' times and the compiled kernels by kind.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/bin
export COLD=1  # every build from an empty cache; none is kept
BIN=${BINS%% *} source tests/oral2550_carry.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for bin in ${BINS:-aam-rs}; do
  xz -dc ".carry/gpu/$bin.xz" > "/tmp/bin/$bin"; chmod +x "/tmp/bin/$bin"
  # CubeCL's caches, and the driver's cache of PTX compiled to machine code (a fresh node has neither).
  rm -rf target/aam-kernels-* target/autotune target/cuda target/hip /tmp/run ~/.nv/ComputeCache
  printf '[compilation.logger]\nlevel = "basic"\nfile = "%s"\n' "$OUT/compile_$bin.log" > cubecl.toml
  start=$(date +%s)
  AAM_LOG=info timeout "${TRAIN_TIMEOUT:-300}" "/tmp/bin/$bin" pretrain --backend cuda \
    --table .carry/oral2550/oral_2550.biom --unifrac-matrix .carry/oral2550/unifrac.unweighted.h5 \
    --rarefy-depth 1000 --epochs "${EPOCHS:-2}" --warmup-steps 100 --num-workers 8 \
    --output-dir /tmp/run ${TRAIN_ARGS:-} > "$OUT/pretrain_$bin.log" 2>&1
  rc=$?
  echo "== $bin: rc=$rc wall=$(( $(date +%s) - start ))s"
  grep -o 'epoch [0-9]*/[0-9]*:.*' "$OUT/pretrain_$bin.log" | sed -E 's/train \[.*\] val \[(.*total_loss [0-9.]+).*\] (lr .*)/val [\1] \2/'
  # The first step: from the model's line to the first step's (`--time-phases` logs step 1;
  # builds with --compile-workers also log "first step done").
  cp /tmp/run/training.log "$OUT/training_$bin.log" 2>/dev/null
  grep -E 'model: [0-9]+ parameters|profile over 1 batches|first step done|helper processes' /tmp/run/training.log 2>/dev/null | cut -c1-160
  log="$OUT/compile_$bin.log"
  [ -f "$log" ] || { echo "no compilation log"; continue; }
  [ "$bin" = "${BINS%% *}" ] && head -c 400 "$log" | cut -c1-200
  echo "kernels compiled: $(grep -c . "$log") (matmul $(grep -ci matmul "$log"), reduce $(grep -ci reduce "$log"))"
done
rm -f cubecl.toml
