#!/usr/bin/env bash
# Data parallel across processes (--world-size) on a machine of two GPUs or more, one process
# per GPU: what a run must survive, and that it trains as one GPU does.
#   stop    pretrain on oral2550, 3 epochs, SIGUSR1 to process 1 only in epoch 2: every process
#           stops at the same step with status 75, process 0 writes the checkpoint; then both
#           resume (--resume-from auto) and end with status 0.
#   crash   the same, process 1 killed (SIGKILL) mid-run: process 0 exits with status 1 and a
#           message naming process 1 within seconds, instead of waiting in NCCL forever.
#   parity  the demo, dropout and masking off, SGD, global batch 16, 6 steps: one GPU against
#           two processes (benches/compare_runs.py).
#   auto    --auto-batch-size --max-memory-fraction 0.05 on one GPU, one epoch.
# Run from the repository root on the GPU machine, carrying .carry/gpu/aam-rs.xz (CUDA build),
# .carry/oral2550/*.xz and optionally .carry/gpu/cache (tests/oral2550_carry.sh).
# Env: PARTS (default "stop crash parity auto"). Prints one line per check and PASS or FAIL;
# exits 1 on a FAIL. $OUT/logs.tar.xz: every log.
set -uo pipefail
source tests/oral2550_carry.sh
status=0
check() { if eval "$2"; then echo "PASS $1"; else echo "FAIL $1"; status=1; fi; }
ORAL="--backend cuda --table .carry/oral2550/oral_2550.biom --unifrac-matrix .carry/oral2550/unifrac.unweighted.h5
  --rarefy-depth 1000 --batch-size 16 --num-workers 8 --epochs 3 --checkpoint-every-steps 25"
PORT=29600
# two NAME EXTRA...: process 1 in the background (pid in P1), process 0 too (pid in P0).
two() {
  local name=$1; shift; PORT=$((PORT + 1))
  # shellcheck disable=SC2086
  /tmp/bin/aam-rs pretrain $ORAL "$@" --world-size 2 --rank 1 --devices 1 --rendezvous 127.0.0.1:$PORT \
    --output-dir "/tmp/$name" > "$OUT/$name.1.log" 2>&1 & P1=$!
  # shellcheck disable=SC2086
  /tmp/bin/aam-rs pretrain $ORAL "$@" --world-size 2 --rank 0 --devices 0 --rendezvous 127.0.0.1:$PORT \
    --output-dir "/tmp/$name" > "$OUT/$name.0.log" 2>&1 & P0=$!
}
# Waits (at most 300 s) until process 0 of NAME has logged its first epoch, then 2 s more.
mid_epoch2() {
  for _ in $(seq 600); do grep -q "epoch 1/" "$OUT/$1.0.log" && break; sleep 0.5; done
  sleep 2
}

part() { [[ " ${PARTS:-stop crash parity auto} " == *" $1 "* ]]; }
if part stop; then
echo "## stop"
two stop
mid_epoch2 stop; kill -USR1 "$P1"
wait "$P1"; rc1=$?; wait "$P0"; rc0=$?
s0=$(grep -oE "at step [0-9]+" "$OUT/stop.0.log" | tail -1); s1=$(grep -oE "at step [0-9]+" "$OUT/stop.1.log" | tail -1)
grep -hE "stopped by" "$OUT/stop.0.log" "$OUT/stop.1.log" | cut -c1-200
echo "process 0: rc $rc0, $s0; process 1: rc $rc1, $s1"
check "both stop with status 75 at the same step" '[ "$rc0" = 75 ] && [ "$rc1" = 75 ] && [ -n "$s0" ] && [ "$s0" = "$s1" ]'
check "process 0 wrote the step checkpoint" '[ -f /tmp/stop/checkpoints/last.safetensors ]'
mv "$OUT/stop.0.log" "$OUT/stopped.0.log"; mv "$OUT/stop.1.log" "$OUT/stopped.1.log"
two stop --resume-from auto
wait "$P1"; rc1=$?; wait "$P0"; rc0=$?
echo "resumed: process 0 rc $rc0, process 1 rc $rc1; $(grep -oE 'resuming from [^;]*' "$OUT/stop.0.log" | head -1)"
check "the resumed run ends" '[ "$rc0" = 0 ] && [ "$rc1" = 0 ] && [ "$(grep -c "^[0-9]" /tmp/stop/metrics.csv)" = 3 ]'

fi
if part crash; then
echo "## crash"
two crash
mid_epoch2 crash; kill -KILL "$P1"; killed=$SECONDS
for _ in $(seq 600); do kill -0 "$P0" 2>/dev/null || break; sleep 0.2; done
kill -0 "$P0" 2>/dev/null && { echo "process 0 still runs 120 s after the kill"; kill -KILL "$P0"; }
wait "$P0"; rc0=$?
echo "process 0: rc $rc0, $((SECONDS - killed)) s after the kill; $(grep -oE 'process 1 of the run stopped[^;]*' "$OUT/crash.0.log" | head -1)"
check "process 0 exits with status 1 naming process 1" '[ "$rc0" = 1 ] && grep -q "process 1 of the run stopped" "$OUT/crash.0.log"'

fi
if part parity; then
echo "## parity"
DEMO="--backend cuda --table crates/data/demo/demo.biom --unifrac-matrix crates/data/demo/unifrac.unweighted.h5
  --rarefy-depth 1000 --epochs 2 --batch-size 16 --dropout 0 --nuc-mask-ratio 0 --optimizer sgd --lr 0.05"
# shellcheck disable=SC2086
/tmp/bin/aam-rs pretrain $DEMO --devices 0 --output-dir /tmp/parity_one > "$OUT/parity_one.log" 2>&1
ORAL=$DEMO
two parity_procs; wait "$P1"; rc1=$?; wait "$P0"; rc0=$?
python3 benches/compare_runs.py /tmp/parity_one /tmp/parity_procs > "$OUT/parity.txt" 2>&1; prc=$?
cat "$OUT/parity.txt"
check "two processes take one GPU's steps" '[ "$rc0" = 0 ] && [ "$rc1" = 0 ] && [ "$prc" = 0 ]'

fi
if part auto; then
echo "## auto"
timeout 300 /tmp/bin/aam-rs pretrain --backend cuda --table .carry/oral2550/oral_2550.biom \
  --unifrac-matrix .carry/oral2550/unifrac.unweighted.h5 --rarefy-depth 1000 --epochs 1 --num-workers 8 \
  --auto-batch-size --max-memory-fraction 0.05 --output-dir /tmp/auto > "$OUT/auto.log" 2>&1; arc=$?
grep -oE -- "--auto-batch-size: batch size .*" "$OUT/auto.log" | cut -c1-300
check "--auto-batch-size finds a batch and trains" '[ "$arc" = 0 ] && grep -q -- "--auto-batch-size: batch size [0-9]" "$OUT/auto.log"'
fi
tar -C "$OUT" -cJf "$OUT/logs.tar.xz" --exclude='*.tar.xz' --exclude='cache.txz*' . 2>/dev/null
exit $status
