#!/usr/bin/env bash
# Training step on the device machine, aam-rs beside the PyTorch reference, on identical
# tensors: `aam-dev step` times pretrain's optimiser step (default model, AdamW) on the
# batch of shared/bench/pt_reference_bench.py (8 samples, 120-500 ASVs of 150 nt in 1024
# slots), once per attention path; then the reference script measures its own step (with and
# without gradient checkpointing, per SDPA backend) in the same call.
#
# Run from the repository root on the GPU machine (docs/gpu-benchmarks.md), with carry [".carry"]:
#   .carry/gpu/aam-dev.{xz,gz} CUDARC_CUDA_VERSION=12080 cargo build --profile device -p aam-dev \
#                              --features cuda,fusion; xz (or gzip)
#   .carry/gpu/cache/          optional: CubeCL's compiled kernels and autotune results from an
#                              earlier call ($OUT/cache.txz.*; benches/kernel_cache.sh), so the
#                              first step skips the JIT
#   .carry/pt_reference_bench.py and .ref/aam (the reference package, never committed)
# Env: VARIANTS (default "auto auto:ckpt math": the attention path, then options, each after
#      a colon: ckpt = --gradient-checkpointing, bf16 / fp16 = --mixed-precision,
#      allslots = --all-slots: the sample level on all 1024 slots, as the reference,
#      tune = --matmul-kernels autotune: CubeCL times the dense products' kernels),
#      BINS (default "aam-dev": binaries .carry/gpu/<name>.xz to time; per variant each binary
#      in this order, so that two builds are interleaved), ROUNDS (default 1: the variants
#      this many times over, files suffixed _r<round> when above 1), BACKEND (cuda), PT (1: also run the reference),
#      STEP_TIMEOUT (s per aam-rs run, default 240), STEP_ARGS (extra flags),
#      COLD (1: start from an empty kernel cache and keep none, as on a fresh node),
#      PROFILE (1: first one more `auto` run with CubeCL's kernel profiler, log in $OUT,
#      summary by benches/kernel_summary.py printed),
#      STEP_ASVS (ASVs per sample, comma-separated, e.g. the oral2550 quantiles
#      25,33,38,43,47,55,77,99: aam-rs times that batch, and PT=1 times the reference's step on
#      the same counts with benches/pt_step.py instead of the whole pt_reference_bench.py).
# Writes to $OUT: step_[<bin>_]<variant>.{json,log}, gpu_mem_*.csv, pt.log, pt_anchor.json,
# cache.txz.*.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/bin
BACKEND=${BACKEND:-cuda}
BINS=${BINS:-aam-dev}
for bin in $BINS; do
  if [ -f ".carry/gpu/$bin.xz" ]; then xz -dc ".carry/gpu/$bin.xz" > "/tmp/bin/$bin"  # smaller carry
  else gunzip -c ".carry/gpu/$bin.gz" > "/tmp/bin/$bin"; fi; chmod +x "/tmp/bin/$bin"
done
first_bin=${BINS%% *}
source benches/kernel_cache.sh; restore_kernel_cache; trap save_kernel_cache EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
export CUBECL_AUTOTUNE_LEVEL=${CUBECL_AUTOTUNE_LEVEL:-minimal}
status=0
STEP_ARGS="${STEP_ARGS:-}${STEP_ASVS:+ --asvs-per-sample $STEP_ASVS}"
if [ "${PROFILE:-0}" = 1 ]; then
  echo "== profiled step (CUBECL_DEBUG_OPTION=profile)"
  CUBECL_DEBUG_LOG="$OUT/cubecl_profile.log" CUBECL_DEBUG_OPTION=profile \
    timeout "${STEP_TIMEOUT:-240}" "/tmp/bin/$first_bin" step --backend "$BACKEND" \
    --warmup 2 --steps 2 $(echo "$STEP_ARGS" | sed -E 's/--steps [0-9]+//') 2>&1 | tail -2
  python3 benches/kernel_summary.py "$OUT/cubecl_profile.log"
  gzip -f "$OUT/cubecl_profile.log"
fi
for round in $(seq "${ROUNDS:-1}"); do
for variant in ${VARIANTS:-auto auto:ckpt math}; do
for bin in $BINS; do
  attn=${variant%%:*}; flags=""
  for opt in $(echo "${variant#"$attn"}" | tr ':' ' '); do
    case $opt in
      ckpt) flags="$flags --gradient-checkpointing" ;;
      bf16|fp16) flags="$flags --mixed-precision $opt" ;;
      allslots) flags="$flags --all-slots" ;;
      tune) flags="$flags --matmul-kernels autotune" ;;
      *) echo "unknown variant option $opt" >&2; exit 2 ;;
    esac
  done
  name=${variant//:/_}; [ "$bin" != aam-dev ] && name="${bin#aam-dev-}_$name"
  [ "${ROUNDS:-1}" -gt 1 ] && name="${name}_r$round"
  [ -e "$OUT/step_$name.json" ] && name="${name}_again"  # a repeated variant
  echo "== $bin step --attn-implementation $attn$flags"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$OUT/gpu_mem_$name.csv" &
  smi=$!
  timeout "${STEP_TIMEOUT:-240}" "/tmp/bin/$bin" step --backend "$BACKEND" \
    --attn-implementation "$attn" $flags --json-out "$OUT/step_$name.json" $STEP_ARGS 2>&1 \
    | tee "$OUT/step_$name.log" | tail -4
  rc=${PIPESTATUS[0]}; [ "$rc" -eq 0 ] || status=1
  kill $smi
  echo "rc=$rc peak nvidia-smi MiB: $(sort -n "$OUT/gpu_mem_$name.csv" | tail -1)"
done
done
done
if [ "${PT:-1}" = 1 ] && [ -n "${STEP_ASVS:-}" ]; then
  echo "== reference step on the same ASV counts (benches/pt_step.py)"
  AAM_SRC=.ref STEP_ASVS=$STEP_ASVS PYTHONUNBUFFERED=1 timeout 300 python3 benches/pt_step.py \
    | tee "$OUT/pt_step.jsonl" || status=1
elif [ "${PT:-1}" = 1 ]; then
  echo "== reference (pt_reference_bench.py)"
  AAM_SRC=.ref OUT=$OUT PYTHONUNBUFFERED=1 timeout 300 python3 .carry/pt_reference_bench.py \
    > "$OUT/pt.log" 2>&1 || status=1
  grep -A12 '== pretrain step' "$OUT/pt.log"
fi
exit $status
