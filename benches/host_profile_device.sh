#!/usr/bin/env bash
# Where the host's time goes in a training step: `perf record` (cpu-clock samples) on aam-rs
# pretrain, full oral2550, the reference's batch of 8 per GPU, f32, two epochs, on GPU 0 and on
# every GPU of the machine (data parallel, one process); per-thread (comm) and per-symbol flat
# profiles. The CubeCL device threads are named DSU-<type>-<index> (Burn's fusion server) and
# DSD-<type>-<index> (CubeCL's compute server, which launches kernels); replica 0 runs on the
# main thread (aam-rs, which also holds the data loader), the others on aam-replica-<rank>.
#
# The GPU machines have no perf: carry Debian's, with its libraries and loader, as
#   mkdir -p /tmp/pp/perf/lib && cp /usr/bin/perf /tmp/pp/perf/ &&
#   for l in $(ldd /usr/bin/perf | awk '$3 ~ /^\// {print $3}') /lib64/ld-linux-x86-64.so.2; do
#     cp -L $l /tmp/pp/perf/lib/; done && tar -C /tmp/pp -cJf .carry/perf.txz perf
# and the binary unstripped (the device profile strips it):
#   CUDARC_CUDA_VERSION=12080 cargo rustc --profile device -p aam-cli --bin aam-rs \
#     --features cuda,fusion -- -C strip=none && xz -c target/device/aam-rs > .carry/gpu/aam-rs-sym.xz
# Carry .carry/perf.txz, .carry/gpu/aam-rs-sym.xz, .carry/oral2550/oral_2550.biom.xz and
# .carry/oral2550/tree.fasttree-midpoint.nwk.xz (the distances are computed from the tree) and,
# to skip compiling, .carry/gpu/cache. Writes $OUT/profile.txt (and .xz).
set -uo pipefail
BIN=aam-rs-sym source tests/oral2550_carry.sh
mkdir -p /tmp/perf && tar -C /tmp/perf -xJf .carry/perf.txz
PERF() { /tmp/perf/perf/lib/ld-linux-x86-64.so.2 --library-path /tmp/perf/perf/lib /tmp/perf/perf/perf "$@"; }
NGPU=$(nvidia-smi -L | wc -l)
ALL=$(seq -s, 0 $((NGPU - 1)))
for spec in "one 0 8" "all $ALL $((8 * NGPU))"; do
  set -- $spec
  PERF record -F 499 -e cpu-clock -g -o "/tmp/$1.perf" -- /tmp/bin/aam-rs pretrain --backend cuda \
    --table .carry/oral2550/oral_2550.biom --tree .carry/oral2550/tree.fasttree-midpoint.nwk \
    --rarefy-depth 1000 --epochs 2 --warmup-steps 100 --num-workers 8 \
    --batch-size "$3" --mixed-precision none --devices "$2" --output-dir "/tmp/run_$1" > "/tmp/$1.log" 2>&1
  echo "== $1 (--devices $2, batch $3) rc=$?"
  grep -oE "epoch [0-9]+/[0-9]+:.*" "/tmp/$1.log" | grep -oE "epoch [0-9]+/[0-9]+|[0-9.]+ samples/s, [0-9.]+s" | paste -sd' '
  report() { PERF report -i "/tmp/$1.perf" --no-children --stdio "${@:2}" 2>/dev/null | grep -v '^#' | grep -v '^$' | cut -c1-200; }
  echo "-- threads"; report "$1" --sort comm -g none | head -20
  echo "-- threads and libraries"; report "$1" --sort comm,dso -g none | head -40
  echo "-- threads and symbols (>= 1%)"; report "$1" --sort comm,sym -g caller --percent-limit 1 | grep -E '^\s+[0-9.]+%' | head -60
done | tee "$OUT/profile.txt"
xz -k "$OUT/profile.txt"
