#!/usr/bin/env bash
# `--auto-batch-size` on a GPU: `pretrain` on the full oral2550 (2,537 samples, rarefied to 1,000
# reads) at the reference's default model (D=128, 4 heads, 4 layers per stack, token_limit 1024,
# max_bp 150) searches the largest batch under each cap of FRACTIONS, then trains one epoch at
# it. nvidia-smi samples the device memory every 200 ms meanwhile (it includes the CUDA
# context), so the run's real peak stands beside the cap.
#
# Run from the repository root on the GPU machine, with .carry/gpu/aam-rs.xz (CUDA build),
# .carry/oral2550/*.xz and optionally .carry/gpu/cache/ (see tests/oral2550_carry.sh).
# Env: FRACTIONS (default "0.05 0.8"), EPOCHS (1), TRAIN_TIMEOUT (s per run, 240).
# Writes to $OUT: auto_<fraction>.log, gpu_mem_<fraction>.csv, cache.txz.*. Exits 1 when a run
# fails or finds no batch size.
set -uo pipefail
status=0
source tests/oral2550_carry.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for fraction in ${FRACTIONS:-0.05 0.8}; do
  rm -rf /tmp/run
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/gpu_mem_$fraction.csv" &
  smi=$!
  start=$(date +%s)
  AAM_LOG=info timeout "${TRAIN_TIMEOUT:-240}" /tmp/bin/aam-rs pretrain --backend cuda \
    --table .carry/oral2550/oral_2550.biom --unifrac-matrix .carry/oral2550/unifrac.unweighted.h5 \
    --rarefy-depth 1000 --epochs "${EPOCHS:-1}" --warmup-steps 10 --num-workers 8 \
    --auto-batch-size --max-memory-fraction "$fraction" --output-dir /tmp/run \
    > "$OUT/auto_$fraction.log" 2>&1
  rc=$?
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  peak=$(sort -n "$OUT/gpu_mem_$fraction.csv" | tail -1)
  echo "== --max-memory-fraction $fraction: rc $rc, $(( $(date +%s) - start )) s, nvidia-smi peak ${peak} MiB"
  grep -E "auto-batch-size|epoch 1/|Error|error|panicked" "$OUT/auto_$fraction.log" | cut -c1-600
  { [ "$rc" = 0 ] && grep -q -- "--auto-batch-size: batch size [0-9]" "$OUT/auto_$fraction.log"; } || status=1
done
exit $status
