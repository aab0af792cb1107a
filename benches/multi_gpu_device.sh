#!/usr/bin/env bash
# Data parallel on every GPU of one machine, beside the reference's two multi-GPU modes, in one call.
#
#   speed     aam-rs pretrain on the full oral2550 at the reference's per-GPU batch (8), default
#             model, f32 and bf16: on GPU 0 (batch 8), and on all N GPUs (batch 8N) with
#             --unifrac-pairs global and local, in one process (MODES threads: a thread per
#             GPU) and in N processes (MODES procs: --world-size N, one GPU each, NCCL). Samples/s of the last epoch (the first compiles
#             kernels), the scaling efficiency (N GPUs / (N x 1 GPU)), and each GPU's peak memory
#             (nvidia-smi, sampled every 200 ms: the same measure for both tools).
#   reference the reference's step, same model and batch per GPU: torch DataParallel
#             (../shared/bench/pt_data_parallel_bench.py, carried as .carry/bench/) and DDP over
#             NCCL (benches/pt_ddp_bench.py via torchrun), each on 1 and N GPUs.
#   parity    the demo, dropout and masking off, global batch 16, 2 epochs (6 steps), SGD:
#             --devices 0 against --devices 0,1 and against N processes (UniFrac pairs global): epoch losses and the
#             final weights. (SGD, as in crates/train/tests/data_parallel.rs: Adam turns the
#             rounding noise of the gradients that are exactly zero into steps of ±lr.)
#   curves    oral2550, dropout and masking on, 3 epochs, global batch 8N: 1 GPU against N GPUs,
#             every step's losses logged (benches/loss_curves.py plots them).
#
# Run from the repository root on the GPU machine (docs/gpu-benchmarks.md), carrying .carry and .ref:
#   .carry/gpu/aam-rs.xz   CUDARC_CUDA_VERSION=12080 cargo build --profile device -p aam-cli
#                          --features cuda,fusion; xz
#   .carry/oral2550/*.xz   oral_2550.biom and unifrac.unweighted.h5 from ../shared/data, xz'd
#   .carry/bench/pt_data_parallel_bench.py   from ../shared/bench
#   .ref/aam               the reference's Python package (git archive of jbk708/aam's aam/)
#   .carry/gpu/cache/      optional: CubeCL's compiled kernels (benches/kernel_cache.sh)
# Env: PARTS (default "reference speed parity curves"), MODES (default "threads procs"),
#      PAIRS (default "global local"), EXTRA (more flags for every speed run, e.g.
#      "--time-phases host"), PRECISIONS (--mixed-precision values,
#      default "none bf16"), EPOCHS (speed runs, default 2), CURVE_EPOCHS (default 3),
#      WIDE (per-GPU batch of one more bf16 pair of speed runs, default 32; 0: none).
# Writes to $OUT: summary.txt; runs.tar.xz holding each run's <name>.log, <name>.csv
#      (metrics.csv), <name>.mem (nvidia-smi samples) and the reference's JSON lines; cache.txz.*.
set -uo pipefail
PARTS=${PARTS:-reference speed parity curves}
source tests/oral2550_carry.sh
NGPU=$(nvidia-smi -L | wc -l)
ALL=$(seq -s, 0 $((NGPU - 1)))
SUMMARY="$OUT/summary.txt"
RUNS="$OUT/runs"; mkdir -p "$RUNS"
# At most a few files come back from a device call: the runs travel as one archive.
bundle() { tar -C "$OUT" -cJf "$OUT/runs.tar.xz" runs && rm -rf "$RUNS"; save_kernel_cache; }
trap bundle EXIT
ratio() { awk -v a="$1" -v b="$2" -v n="${3:-1}" 'BEGIN { if (a > 0 && b > 0) printf "%.3f", a / (n * b); else print "?" }'; }
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -$((NGPU + 1)); } | tee "$SUMMARY"

# Runs "$@" with nvidia-smi sampling every GPU's memory; prints the peak MiB of each GPU.
with_memory() {
  local name=$1; shift
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "$RUNS/$name.mem" &
  local watcher=$!
  "$@"; local rc=$?
  kill $watcher 2>/dev/null; wait $watcher 2>/dev/null
  PEAK=$(awk -F', *' '{ if ($2 > m[$1]) m[$1] = $2 } END { for (g in m) printf "gpu%s %d MiB  ", g, m[g] }' "$RUNS/$name.mem")
  return $rc
}

# "$@" (an aam-rs command) as NGPU processes, one per GPU (--world-size, --rank, --devices
# <rank>, a rendezvous on this host); process 0's output on stdout, the others' in
# $RUNS/$PROCS_NAME.rank<r>.log. Returns the first non-zero exit status.
PORT=29555
procs() {
  PORT=$((PORT + 1))
  local pids=() r rc=0
  for r in $(seq 1 $((NGPU - 1))); do
    "$@" --world-size "$NGPU" --rank "$r" --devices "$r" --rendezvous "127.0.0.1:$PORT" \
      > "$RUNS/$PROCS_NAME.rank$r.log" 2>&1 &
    pids+=($!)
  done
  "$@" --world-size "$NGPU" --rank 0 --devices 0 --rendezvous "127.0.0.1:$PORT"; rc=$?
  for p in "${pids[@]}"; do wait "$p" || [ $rc -ne 0 ] || rc=$?; done
  return $rc
}

# aam-rs pretrain on oral2550: name, devices (`procs`: one process per GPU), global batch,
# precision, epochs, extra flags.
pretrain() {
  local name=$1 devices=$2 batch=$3 precision=$4 epochs=$5; shift 5
  local start=$SECONDS launch=() dev=(--devices "$devices")
  if [ "$devices" = procs ]; then launch=(procs); dev=(); PROCS_NAME=$name; fi
  with_memory "$name" "${launch[@]}" timeout 300 /tmp/bin/aam-rs pretrain --backend cuda \
    --table .carry/oral2550/oral_2550.biom --unifrac-matrix .carry/oral2550/unifrac.unweighted.h5 \
    --rarefy-depth 1000 --epochs "$epochs" --warmup-steps 100 --num-workers 8 \
    --batch-size "$batch" --mixed-precision "$precision" "${dev[@]}" "$@" ${EXTRA:-} \
    --output-dir "/tmp/run_$name" > "$RUNS/$name.log" 2>&1
  local rc=$?
  cp "/tmp/run_$name/metrics.csv" "$RUNS/$name.csv" 2>/dev/null
  # The last epoch's training samples/s.
  RATE=$(grep -oE "epoch [0-9]+/[0-9]+:.*" "$RUNS/$name.log" | tail -1 | grep -oE "[0-9.]+ samples/s" | cut -d' ' -f1)
  printf "%-18s --devices %-8s batch %3s %-4s rc=%s  %8s samples/s  wall %4ss  peak %s\n" \
    "$name" "$devices" "$batch" "$precision" "$rc" "${RATE:-?}" "$((SECONDS - start))" "$PEAK" | tee -a "$SUMMARY"
}

if [[ " $PARTS " == *" reference "* ]]; then
  echo "## reference (torch $(python3 -c 'import torch; print(torch.__version__)'))" | tee -a "$SUMMARY"
  with_memory reference_dp env AAM_SRC=.ref timeout 300 python3 .carry/bench/pt_data_parallel_bench.py \
    > "$RUNS/reference_dp.jsonl" 2> "$RUNS/reference_dp.err"
  echo "DataParallel rc=$? peak(nvidia-smi) $PEAK" | tee -a "$SUMMARY"; cat "$RUNS/reference_dp.jsonl" | tee -a "$SUMMARY"
  for n in 1 "$NGPU"; do
    with_memory "reference_ddp$n" env AAM_SRC=.ref timeout 300 python3 -m torch.distributed.run --standalone \
      --nproc_per_node "$n" benches/pt_ddp_bench.py > "$RUNS/reference_ddp$n.jsonl" 2> "$RUNS/reference_ddp$n.err"
    echo "DDP on $n GPU(s) rc=$? peak(nvidia-smi) $PEAK" | tee -a "$SUMMARY"; grep '^{' "$RUNS/reference_ddp$n.jsonl" | tee -a "$SUMMARY"
  done
fi

if [[ " $PARTS " == *" speed "* ]]; then
  echo "## aam-rs speed, oral2550, 8 samples per GPU, $(nproc) host cores" | tee -a "$SUMMARY"
  for precision in ${PRECISIONS:-none bf16}; do
    pretrain "one_$precision" 0 8 "$precision" "${EPOCHS:-2}" --dropout 0 --nuc-mask-ratio 0
    ONE=$RATE
    for mode in ${MODES:-threads procs}; do
      devices=$ALL; [ "$mode" = procs ] && devices=procs
      for pairs in ${PAIRS:-global local}; do
        pretrain "${mode}_${pairs}_$precision" "$devices" $((8 * NGPU)) "$precision" "${EPOCHS:-2}" \
          --dropout 0 --nuc-mask-ratio 0 --unifrac-pairs "$pairs"
        echo "  scaling efficiency ($mode, $pairs, $precision, $NGPU GPUs): $(ratio "$RATE" "$ONE" "$NGPU")" | tee -a "$SUMMARY"
      done
    done
  done
  if [ "${WIDE:-32}" -gt 0 ]; then
    pretrain "one_wide_bf16" 0 "$WIDE" bf16 "${EPOCHS:-2}" --dropout 0 --nuc-mask-ratio 0
    ONE=$RATE
    pretrain "all_wide_bf16" "$ALL" $((WIDE * NGPU)) bf16 "${EPOCHS:-2}" --dropout 0 --nuc-mask-ratio 0
    echo "  scaling efficiency (global, bf16, $WIDE per GPU, $NGPU GPUs): $(ratio "$RATE" "$ONE" "$NGPU")" | tee -a "$SUMMARY"
  fi
fi

if [[ " $PARTS " == *" parity "* ]]; then
  echo "## parity: demo, global batch 16, dropout and masking off, SGD, 2 epochs" | tee -a "$SUMMARY"
  for run in parity_one:0 "parity_all:$ALL" parity_procs:procs; do
    name=${run%%:*}; devices=${run#*:}
    launch=(); dev=(--devices "$devices")
    if [ "$devices" = procs ]; then launch=(procs); dev=(); PROCS_NAME=$name; fi
    "${launch[@]}" timeout 300 /tmp/bin/aam-rs pretrain --backend cuda --table crates/data/demo/demo.biom \
      --unifrac-matrix crates/data/demo/unifrac.unweighted.h5 --rarefy-depth 1000 --epochs 2 --batch-size 16 \
      --dropout 0 --nuc-mask-ratio 0 --optimizer sgd --lr 0.05 "${dev[@]}" \
      --output-dir "/tmp/run_$name" > "$RUNS/$name.log" 2>&1
    echo "$name --devices $devices rc=$?" | tee -a "$SUMMARY"
    cp "/tmp/run_$name/metrics.csv" "$RUNS/$name.csv" 2>/dev/null
  done
  python3 benches/compare_runs.py /tmp/run_parity_one /tmp/run_parity_all | tee -a "$SUMMARY"
  python3 benches/compare_runs.py /tmp/run_parity_one /tmp/run_parity_procs | tee -a "$SUMMARY"
fi

if [[ " $PARTS " == *" curves "* ]]; then
  echo "## curves: oral2550, dropout and masking on, ${CURVE_EPOCHS:-3} epochs, batch $((8 * NGPU))" | tee -a "$SUMMARY"
  for run in curve_one:0 "curve_all:$ALL"; do
    name=${run%%:*}; devices=${run#*:}
    AAM_LOG=info,aam_train=debug pretrain "$name" "$devices" $((8 * NGPU)) none "${CURVE_EPOCHS:-3}"
  done
fi
