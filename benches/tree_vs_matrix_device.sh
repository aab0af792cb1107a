#!/usr/bin/env bash
# Pretraining on the full oral2550 with UniFrac targets from ssu's matrix against targets that
# aam-rs computes from the tree in the run (`--tree`), in one device call: the same flags, seed
# and steps, every step's losses logged (benches/loss_curves.py draws them).
#
# Run from the repository root on the GPU machine, carrying .carry (as benches/pretrain_device.sh,
# with .carry/oral2550/tree.fasttree-midpoint.nwk.xz besides the table and matrix).
# Env: EPOCHS (default 5). Writes to $OUT: summary.txt, runs.tar.xz (each run's aam.log and
# metrics.csv), cache.txz.*.
set -uo pipefail
OUT=${OUT:-/tmp/out}
ROOT=$OUT
mkdir -p "$ROOT/runs"
for run in matrix tree; do
  case $run in
    matrix) unifrac="--unifrac-matrix .carry/oral2550/unifrac.unweighted.h5" ;;
    tree) unifrac="--tree .carry/oral2550/tree.fasttree-midpoint.nwk" ;;
  esac
  mkdir -p "$ROOT/$run"
  OUT="$ROOT/$run" PT=0 EPOCHS=${EPOCHS:-5} AAM_LOG=info,aam_train=debug UNIFRAC="$unifrac" \
    bash benches/pretrain_device.sh > "$ROOT/$run/script.log" 2>&1
  echo "$run rc=$?" | tee -a "$ROOT/summary.txt"
  grep -E "epoch [0-9]+/[0-9]+:|unifrac|error" "$ROOT/$run/aam.log" | grep -v DEBUG | tee -a "$ROOT/summary.txt"
  cp "$ROOT/$run/aam.log" "$ROOT/runs/$run.log"; cp "$ROOT/$run/metrics.csv" "$ROOT/runs/$run.csv" 2>/dev/null
  # The kernel cache comes back once, from the last run.
  [ "$run" = tree ] && mv "$ROOT/$run"/cache.txz.* "$ROOT/" 2>/dev/null
  rm -rf "${ROOT:?}/$run"
done
tar -C "$ROOT" -cJf "$ROOT/runs.tar.xz" runs && rm -rf "$ROOT/runs"
