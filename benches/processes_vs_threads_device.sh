#!/usr/bin/env bash
# What two GPUs give in one process against two processes, in one call on a 2-GPU machine: one GPU
# alone; two independent one-GPU trainings at once, one process per GPU (no communication: the host's
# own limit); one process on both GPUs (data parallel, a thread per replica, NCCL). Two rounds.
# Pretrain, full oral2550 (distances from the tree), batch 8 per GPU, f32, 2 epochs; samples/s of
# epoch 2. Carry .carry/gpu/aam-rs-sym.xz (or set BIN), .carry/oral2550/oral_2550.biom.xz,
# .carry/oral2550/tree.fasttree-midpoint.nwk.xz and, to skip compiling, .carry/gpu/cache.
set -uo pipefail
BIN=${BIN:-aam-rs-sym} source tests/oral2550_carry.sh
run() { # name devices batch [env]
  local name=$1 dev=$2 batch=$3; shift 3
  env "$@" /tmp/bin/aam-rs pretrain --backend cuda \
    --table .carry/oral2550/oral_2550.biom --tree .carry/oral2550/tree.fasttree-midpoint.nwk \
    --rarefy-depth 1000 --epochs 2 --warmup-steps 100 --num-workers 8 \
    --batch-size "$batch" --mixed-precision none --devices "$dev" --output-dir "/tmp/run_$name" > "/tmp/$name.log" 2>&1
  echo "$name rc=$? $(grep -oE 'epoch 2/2:.*' /tmp/$name.log | grep -oE '[0-9.]+ samples/s')"
}
for round in 1 2; do
  echo "== round $round"
  run one 0 8 X=1
  run procA 0 8 CUDA_VISIBLE_DEVICES=0 & run procB 0 8 CUDA_VISIBLE_DEVICES=1 & wait
  run both 0,1 16 X=1
done | tee $OUT/dp_ab.txt
