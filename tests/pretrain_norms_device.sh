#!/usr/bin/env bash
# Gradient norms of `aam-rs pretrain`'s first steps on the device, one short run per variant of
# the flags, on the full oral2550 at the default model (docs/gpu-benchmarks.md): which part of the
# training loop (dropout, nucleotide masking, the optimiser) makes the norms grow. Run from the
# repository root with carry [".carry/gpu", ".carry/oral2550"] (as tests/gradients_device.sh).
# Env: VARIANTS (";"-separated flag sets, one run each), ARGS (flags for every run),
# RUN_TIMEOUT (s per run, default 150: the run is stopped there, its log kept), BACKEND (cuda).
# Writes norms_<i>.log.gz (every step's losses and gradient norm, AAM_LOG=aam_train=debug) and
# cache.txz.* to $OUT; prints each run's first 12 and last 4 steps.
set -uo pipefail
source tests/oral2550_carry.sh
i=0
IFS=';' read -ra variants <<< "${VARIANTS:---dropout 0 --nuc-mask-ratio 0}"
for extra in "${variants[@]}"; do
  echo "== pretrain $extra ${ARGS:-}"
  start=$(date +%s)
  # shellcheck disable=SC2086
  AAM_LOG=info,aam_train=debug timeout "${RUN_TIMEOUT:-150}" /tmp/bin/aam-rs pretrain \
    --backend "${BACKEND:-cuda}" --table .carry/oral2550/oral_2550.biom \
    --unifrac-matrix .carry/oral2550/unifrac.unweighted.h5 --rarefy-depth 1000 --epochs 1 \
    --warmup-steps 100 --num-workers 8 --max-grad-norm 1e9 --output-dir "/tmp/run_$i" \
    ${ARGS:-} $extra > "/tmp/norms_$i.log" 2>&1
  rc=$?
  echo "rc=$rc wall=$(( $(date +%s) - start ))s steps=$(grep -c 'grad_norm' "/tmp/norms_$i.log")"
  grep -v "Tuning\|autotune" "/tmp/norms_$i.log" | grep "grad_norm\|ERROR\|Error\|error" \
    | sed 's/.*DEBUG aam_train::run: //' | cut -c1-200 > "/tmp/steps_$i"
  head -12 "/tmp/steps_$i"; echo ...; tail -4 "/tmp/steps_$i"
  gzip -c "/tmp/norms_$i.log" > "$OUT/norms_$i.log.gz"
  i=$((i + 1))
done
