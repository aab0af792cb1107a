#!/usr/bin/env bash
# Pretraining throughput on the device machine: aam-rs `pretrain` on the full oral2550
# (2,537 samples x 5,574 ASVs, rarefied to 1,000 reads) at the reference's default model
# (D=128, 4 heads, 4 layers per stack, token_limit 1024, max_bp 150, batch 8, nucleotide
# masking 0.15, ASV chunk 256), beside the PyTorch reference's optimiser step at the same
# model measured in the same call (shared/bench/pt_reference_bench.py).
#
# Run from the repository root on the GPU machine (docs/gpu-benchmarks.md), with carried:
#   .carry/gpu/aam-rs.xz      CUDARC_CUDA_VERSION=12080 cargo build --profile device -p aam-cli
#                             --features cuda,fusion; xz
#   .carry/gpu/cache/         optional: CubeCL's compiled kernels and autotune results from an
#                             earlier call ($OUT/cache.txz.*; benches/kernel_cache.sh), so the
#                             first epoch skips the JIT
#   .carry/oral2550/*.xz      oral_2550.biom and unifrac.unweighted.h5 from ../shared/data, xz'd
#                             (tests/oral2550_carry.sh unpacks them and the binary)
#   .carry/pt_reference_bench.py and .ref/aam (the reference package, never committed)
# Env: EPOCHS (default 2), BACKEND (cuda), ATTN (auto), PT (1: also run the reference),
#      AAM_LOG (default info; info,aam_train=debug logs every step's loss),
#      TRAIN_TIMEOUT (s, default 480), TRAIN_ARGS (extra flags), BIN (default aam-rs: the
#      binary .carry/gpu/$BIN.xz, e.g. a fusion build), UNIFRAC (default
#      `--unifrac-matrix .carry/oral2550/unifrac.unweighted.h5`; `--tree
#      .carry/oral2550/tree.fasttree-midpoint.nwk` computes the matrix in the run).
# Writes to $OUT: aam.log, metrics.csv, loss.png, gpu_mem.csv, pt.log, pt_anchor.json, cache.txz.*.
set -uo pipefail
EPOCHS=${EPOCHS:-2}; BACKEND=${BACKEND:-cuda}; ATTN=${ATTN:-auto}; PT=${PT:-1}
source tests/oral2550_carry.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ "$PT" = 1 ]; then
  AAM_SRC=.ref OUT=$OUT PYTHONUNBUFFERED=1 python3 .carry/pt_reference_bench.py > "$OUT/pt.log" 2>&1
  grep -A20 '== pretrain step' "$OUT/pt.log"
fi
# Device memory in use, every 200 ms, while aam-rs runs (includes the CUDA context).
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/gpu_mem.csv" &
SMI=$!
start=$(date +%s)
rm -rf /tmp/run
AAM_LOG=${AAM_LOG:-info} timeout "${TRAIN_TIMEOUT:-480}" /tmp/bin/aam-rs pretrain --backend "$BACKEND" --attn-implementation "$ATTN" \
  --table .carry/oral2550/oral_2550.biom ${UNIFRAC:---unifrac-matrix .carry/oral2550/unifrac.unweighted.h5} \
  --rarefy-depth 1000 --epochs "$EPOCHS" --warmup-steps 100 --num-workers 8 \
  --output-dir /tmp/run ${TRAIN_ARGS:-} > "$OUT/aam.log" 2>&1
rc=$?
kill $SMI
echo "aam-rs rc=$rc wall=$(( $(date +%s) - start ))s peak_gpu_mem_mib=$(sort -n "$OUT/gpu_mem.csv" | tail -1)"
tail -n 8 "$OUT/aam.log"
cp /tmp/run/metrics.csv "$OUT/" 2>/dev/null; cp /tmp/run/plots/loss.png "$OUT/" 2>/dev/null
exit $rc
