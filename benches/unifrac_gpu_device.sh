#!/usr/bin/env bash
# `aam-rs unifrac --gpu cuda` beside `ssu` on all the device machine's cores,
# in one call: benches/unifrac.sh with GPU=cuda on oral2550 and a synthetic
# table of SAMPLES samples (both methods the issue names), every other method
# on oral2550 for exactness, and one logged run of the synthetic table for
# the time of each phase (reading, computing, writing) of each of PHASE_METHODS
# (default: unweighted weighted_normalized).
# PARTS (default "timed exactness phases") picks among those and two more:
# "vaw" (every method variance adjusted on oral2550, against `ssu --vaw`) and
# "pretrain" (one epoch of `pretrain --tree --unifrac-gpu cuda` on oral2550).
# Carried (made here):
#   .carry/gpu/aam-rs.xz          CUDA build (`--profile device -p aam-cli --features cuda,fusion`)
#   .carry/unifrac/unifrac-bench.xz, ssu.tar.xz   (`bash benches/unifrac_gpu_device.sh pack`)
#   .carry/oral2550/*.xz          the oral2550 table and tree
# Run: `THREADS=16 SAMPLES=20000 bash benches/unifrac_gpu_device.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=.carry/unifrac
if [ "${1:-}" = pack ]; then
  bash benches/unifrac_device.sh pack-ssu
  xz -T2 -6 -c target/device/unifrac-bench > "$CARRY/unifrac-bench.xz"
  du -sh "$CARRY"
  exit 0
fi
THREADS=${THREADS:-$(nproc)}
SAMPLES=${SAMPLES:-20000}
W=$(mktemp -d)
mkdir -p "$W/bin" "$W/data/oral2550"
xz -dc .carry/gpu/aam-rs.xz > "$W/bin/aam-rs"
xz -dc "$CARRY/unifrac-bench.xz" > "$W/bin/unifrac-bench"
chmod +x "$W/bin/"*
tar -C "$W" -xJf "$CARRY/ssu.tar.xz"
xz -dc .carry/oral2550/oral_2550.biom.xz > "$W/data/oral2550/oral_2550.biom"
xz -dc .carry/oral2550/tree.fasttree-midpoint.nwk.xz > "$W/data/oral2550/tree.fasttree-midpoint.nwk"
export PATH="$W/bin:$PATH" LD_LIBRARY_PATH="$W/lib"
echo "ssu: Debian unifrac-tools 1.2-2 (carried)"
D="$W/data/oral2550"
PARTS=${PARTS:-timed exactness phases}
part() { [[ " $PARTS " == *" $1 "* ]]; }
if part timed || part phases; then
  "$W/bin/unifrac-bench" synth --table "$D/oral_2550.biom" --samples "$SAMPLES" --output "$W/synth.biom"
fi
# The first run compiles the kernels (NVRTC): once, before the timed runs.
aam-rs unifrac --table "$D/oral_2550.biom" --tree "$D/tree.fasttree-midpoint.nwk" --gpu cuda \
  --output "$W/warm.h5" 2>&1 | grep -E 'computed|wrote' || true
if part timed; then
  echo "== timed: aam-rs --gpu cuda and ssu ($THREADS threads), fp64"
  GPU=cuda THREADS=$THREADS SAMPLES=$SAMPLES SYNTH="$W/synth.biom" BIN="$W/bin" DATA="$D" bash benches/unifrac.sh
fi
if part exactness; then
  echo "== exactness: the other methods on oral2550"
  GPU=cuda THREADS=$THREADS SAMPLES=0 METHODS="weighted_unnormalized generalized" BIN="$W/bin" DATA="$D" bash benches/unifrac.sh
fi
if part vaw; then
  echo "== exactness: every method variance adjusted on oral2550"
  GPU=cuda VAW=1 THREADS=$THREADS SAMPLES=0 METHODS="unweighted weighted_normalized weighted_unnormalized generalized" \
    BIN="$W/bin" DATA="$D" bash benches/unifrac.sh
fi
if part phases; then
  for method in ${PHASE_METHODS:-unweighted weighted_normalized}; do
    echo "== phases: the synthetic table, $method"
    AAM_LOG=aam_unifrac=debug,aam_data=debug,info aam-rs unifrac --table "$W/synth.biom" --tree "$D/tree.fasttree-midpoint.nwk" --gpu cuda \
      --method "$method" --output "$W/phases.h5" 2>&1 | grep -v -E 'cubecl|Using adapter' || true
    rm -f "$W/phases.h5"
  done
fi
if part pretrain; then
  # Training's kernels from an earlier call, where carried (.carry/gpu/cache).
  source benches/kernel_cache.sh
  restore_kernel_cache
  echo "== pretrain --tree --unifrac-gpu cuda --backend cuda on oral2550, one epoch"
  aam-rs pretrain --table "$D/oral_2550.biom" --tree "$D/tree.fasttree-midpoint.nwk" --unifrac-gpu cuda \
    --rarefy-depth 1000 --epochs 1 --batch-size 8 --backend cuda --output-dir "$W/run" 2>&1 \
    | grep -E 'UniFrac|epoch|error|Error' | grep -v -E 'cubecl' || true
fi
rm -rf "$W"
