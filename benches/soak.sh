#!/usr/bin/env bash
# Soak: a long CPU pre-training on the bundled demo with the process's
# resident memory (VmRSS) sampled every 10 s; a leak shows as growth after
# the first epoch. At the end the run gets SIGTERM, which must stop it at a
# step with a checkpoint (exit status 75).
#
#   MINUTES=30 BIN=target/release/aam-rs bash benches/soak.sh > soak.tsv
# (DURATION=<seconds> instead of MINUTES for a short check.)
#
# Columns: seconds since start, RSS in MiB, epochs finished.
set -euo pipefail
cd "$(dirname "$0")/.."
MINUTES="${MINUTES:-30}"
BIN="${BIN:-target/release/aam-rs}"
OUT="${OUT:-$(mktemp -d)/soak}"
D=crates/data/demo
"$BIN" pretrain --table $D/demo.biom --unifrac-matrix $D/unifrac.unweighted.h5 \
  --rarefy-depth 1000 --max-bp 100 --token-limit 256 --embedding-dim 64 --attention-layers 2 \
  --epochs 100000 --patience 100000 --warmup-steps 20 --lr 5e-4 --checkpoint-every-steps 20 \
  --output-dir "$OUT" 2>"$OUT.log" &
pid=$!
end=$((SECONDS + ${DURATION:-$((MINUTES * 60))}))
echo -e "seconds\trss_mib\tepochs"
while [ $SECONDS -lt $end ] && kill -0 $pid 2>/dev/null; do
  rss=$(awk '/^VmRSS/ {print $2}' /proc/$pid/status 2>/dev/null || echo 0)
  epochs=0
  [ -f "$OUT/metrics.csv" ] && epochs=$(($(wc -l <"$OUT/metrics.csv") - 1))
  echo -e "$SECONDS\t$((rss / 1024))\t$epochs"
  sleep 10
done
kill -TERM $pid
status=0; wait $pid || status=$?
echo "# exit status after SIGTERM: $status (75: stopped at a step with a checkpoint)"
tail -n 1 "$OUT.log" | sed 's/^/# /'
