#!/usr/bin/env bash
# `aam-rs diagnose gradients` on the device machine: pretraining's losses and every parameter
# gradient on CUDA against the CPU's, from the same weights, on real oral2550 batches at the
# default model size (docs/gpu-benchmarks.md). Run from the repository root with carry
# [".carry/gpu", ".carry/oral2550"]:
#   .carry/gpu/aam-rs.xz      CUDARC_CUDA_VERSION=12080 cargo build --profile device -p aam-cli
#                             --features cuda,fusion; xz
#   .carry/gpu/cache/         optional: CubeCL's kernel cache of a previous run (benches/kernel_cache.sh)
#   .carry/oral2550/*.xz      oral_2550.biom and unifrac.unweighted.h5 from ../shared/data, xz'd
# Env: BACKEND (cuda), RUNS (";"-separated extra flags, one check each; default: the auto
# attention path, then math), ARGS (flags for every run), GRAD_TIMEOUT (s per run, default 400:
# a cold kernel cache takes minutes of compiling and autotuning, and the cache is saved at the end).
# Writes gradients_<i>.{txt,json} and cache.txz.* to $OUT.
set -uo pipefail
source tests/oral2550_carry.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
status=0; i=0
IFS=';' read -ra runs <<< "${RUNS:---attn-implementation auto;--attn-implementation math}"
for extra in "${runs[@]}"; do
  echo "== diagnose gradients $extra"
  start=$(date +%s)
  # shellcheck disable=SC2086
  timeout "${GRAD_TIMEOUT:-400}" /tmp/bin/aam-rs diagnose gradients --backend "${BACKEND:-cuda}" \
    --table .carry/oral2550/oral_2550.biom --unifrac-matrix .carry/oral2550/unifrac.unweighted.h5 \
    --rarefy-depth 1000 --json-out "$OUT/gradients_$i.json" ${ARGS:-} $extra 2>&1 \
    | while IFS= read -r line; do echo "$(( $(date +%s) - start ))s $line"; done > "$OUT/gradients_$i.txt"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || status=1
  grep -v "Tuning\|autotune cache" "$OUT/gradients_$i.txt" | cut -c1-400 | tail -30; grep -c Tuning "$OUT/gradients_$i.txt"; grep Tuning "$OUT/gradients_$i.txt" | tail -2 | cut -c1-60
  echo "rc=$rc wall=$(( $(date +%s) - start ))s"
  i=$((i + 1))
done
exit $status
