#!/usr/bin/env bash
# `aam-rs serve` under load beside offline `aam-rs embed` on the GPU machine: serve-bench
# (benches/src/serve_load.rs) on the full oral2550 table, concurrency 1, 16 and 64.
#
# Run from the repository root on the GPU machine (docs/gpu-benchmarks.md), with carried:
#   .carry/serve/aam-rs.xz        CUDARC_CUDA_VERSION=12080 cargo build --profile device -p aam-cli
#                                 --features cuda,fusion; xz
#   .carry/serve/serve-bench.xz   cargo build --profile device -p aam-benches --bin serve-bench; xz
#   .carry/serve/model.safetensors.xz   a checkpoint (the reference's default model: pretrain
#                                 with default flags on the demo table, 1 epoch, CPU), its
#                                 `optim.*` tensors dropped (inference reads the weights only)
#   .carry/serve/oral_2550.biom.xz  from ../shared/data/oral2550
#   .carry/gpu/cache/             optional: CubeCL's compiled kernels (benches/kernel_cache.sh)
# Env: REQUESTS (per phase, default 1280), BACKEND (cuda), BINS (the aam-rs builds to run in turn,
#      default .carry/serve/aam-rs.xz; several, space-separated, for an A/B in one call),
#      COLD_EACH (1: each build starts from an empty kernel cache, as on a fresh node; none is kept),
#      SERVE_ARGS (more `aam-rs serve` flags, e.g. "--max-batch-asvs=8192"),
#      ROUNDS (the offline runs and the phases this many times, medians compared; needs a
#      serve-bench with --rounds).
# Writes to $OUT: serve-<k>.txt and serve-<k>.json for the k-th of BINS, cache.txz.*.
set -uo pipefail
source benches/kernel_cache.sh
restore_kernel_cache
mkdir -p /tmp/bin /tmp/serve
xz -dc .carry/serve/serve-bench.xz > /tmp/bin/serve-bench; chmod +x /tmp/bin/serve-bench
xz -dc .carry/serve/model.safetensors.xz > /tmp/serve/model.safetensors
xz -dc .carry/serve/oral_2550.biom.xz > /tmp/serve/oral_2550.biom
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nproc
k=0
for bin in ${BINS:-.carry/serve/aam-rs.xz}; do
  k=$((k + 1))
  xz -dc "$bin" > "/tmp/bin/aam-rs-$k"; chmod +x "/tmp/bin/aam-rs-$k"
  echo "== $k: $bin"
  [ "${COLD_EACH:-0}" = 1 ] && rm -rf target/aam-kernels-* target/autotune target/cuda target/hip
  /tmp/bin/serve-bench --aam-rs "/tmp/bin/aam-rs-$k" --model /tmp/serve/model.safetensors \
    --table /tmp/serve/oral_2550.biom --backend "${BACKEND:-cuda}" --batch-size 64 \
    --concurrency 1,16,64 --requests "${REQUESTS:-1280}" ${ROUNDS:+--rounds "$ROUNDS"} --json "$OUT/serve-$k.json" \
    $(for a in ${SERVE_ARGS:-}; do printf -- '--serve-arg=%s ' "$a"; done) 2>&1 | tee "$OUT/serve-$k.txt"
done
[ "${COLD_EACH:-0}" = 1 ] || save_kernel_cache
