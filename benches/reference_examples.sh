#!/usr/bin/env bash
# The reference's own documented example commands (jbk708/aam README.md,
# docs/getting-started.md, docs/user-guide.md), run with `aam` replaced by
# aam-rs and the data paths by the bundled demo (64 oral2550 samples, whose
# 1,000 reads per sample also set --rarefy-depth 1000: the reference's
# default depth of 5,000 needs deeper samples). Checkpoint paths stay the
# reference's: aam-rs writes checkpoints/best_model.pt. Each command must end
# with status 0; the script stops at the first that does not.
#
#   AAM_RS=target/release/aam-rs OUT=/tmp/reference-examples bash benches/reference_examples.sh
#
# Commands needing several GPUs (--data-parallel, torchrun --fsdp/--distributed)
# run on the devices there are. The user guide's 380M-parameter example is
# left out (a GPU's work, not a demo's); its medium one runs one epoch.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$(realpath "${AAM_RS:-target/release/aam-rs}")
OUT=${OUT:-/tmp/reference-examples}
ROOT=$PWD
D=crates/data/demo
rm -rf "$OUT" && mkdir -p "$OUT" && cd "$OUT"
# EXTRA: more options for pretrain/train (e.g. --device cuda on a GPU build).
# PARTS: which documents' commands to run (default all): readme guide scale.
EXTRA=${EXTRA:-}
PARTS=${PARTS:-readme guide scale}
part() { [[ " $PARTS " == *" $1 "* ]]; }
aam() {
  echo "+ aam-rs $* $EXTRA" >&2
  local t0
  t0=$(date +%s%N)
  # shellcheck disable=SC2086
  "$BIN" "$@" --rarefy-depth 1000 $EXTRA > /dev/null 2> last.log || { cat last.log; exit 1; }
  echo "  $(tail -1 last.log | sed 's/^ *INFO [a-z_:]*: //') ($((($(date +%s%N) - t0) / 1000000)) ms)" >&2
}
TABLE=$ROOT/$D/demo.biom
H5=$ROOT/$D/unifrac.unweighted.h5
NPY=$ROOT/$D/unifrac.weighted_normalized.npy
TSV=$ROOT/$D/demo_map.txt
COL=age
# A metadata copy with the user guide's categorical columns (location, season).
awk -F'\t' 'BEGIN{OFS="\t"} NR==1{print $0,"location","season"; next} {print $0, (NR%2?"indoor":"outdoor"), (NR%3?"fall":"spring")}' "$TSV" > meta.tsv

if part readme; then
# README.md, Quick Start
aam pretrain --table "$TABLE" --unifrac-matrix "$H5" --output-dir output/pretrain --epochs 5
aam train --table "$TABLE" --unifrac-matrix "$H5" --metadata "$TSV" --metadata-column $COL \
  --pretrained-encoder output/pretrain/checkpoints/best_model.pt --output-dir output/train
"$BIN" predict --model output/train/checkpoints/best_model.pt --table "$TABLE" --output predictions.tsv 2> last.log
echo "+ aam-rs predict: $(($(wc -l < predictions.tsv) - 1)) predictions" >&2

# docs/getting-started.md
aam pretrain --table "$TABLE" --unifrac-matrix "$H5" --output-dir gs/pretrain --epochs 5 --batch-size 8
aam train --table "$TABLE" --unifrac-matrix "$H5" --metadata "$TSV" --metadata-column $COL \
  --output-dir gs/train --pretrained-encoder gs/pretrain/checkpoints/best_model.pt --epochs 10 --batch-size 8
aam train --table "$TABLE" --unifrac-matrix "$H5" --metadata "$TSV" --metadata-column $COL \
  --output-dir gs/oom --token-limit 256 --batch-size 2 --gradient-accumulation-steps 16 --epochs 2
fi

# docs/user-guide.md (the "..." fragments completed with the required options and --epochs 2)
if part guide; then
REQ=(--table "$TABLE" --unifrac-matrix "$NPY" --metadata meta.tsv --metadata-column $COL --epochs 2)
aam pretrain --table "$TABLE" --unifrac-matrix "$NPY" --output-dir ug/pretrain --batch-size 8 --epochs 100
aam train --table "$TABLE" --unifrac-matrix "$NPY" --metadata "$TSV" --metadata-column $COL \
  --output-dir ug/stage2 --pretrained-encoder ug/pretrain/pretrained_encoder.pt --freeze-base --batch-size 8 --epochs 100
aam train --table "$TABLE" --unifrac-matrix "$NPY" --metadata "$TSV" --metadata-column $COL --output-dir ug/single --epochs 100
aam train "${REQ[@]}" --output-dir ug/minmax --target-transform minmax
aam train "${REQ[@]}" --output-dir ug/logminmax --target-transform log-minmax
aam train "${REQ[@]}" --output-dir ug/zcat --target-transform zscore-category --normalize-by season
aam train "${REQ[@]}" --output-dir ug/quantile --loss-type quantile --quantiles 0.1,0.5,0.9
aam train "${REQ[@]}" --output-dir ug/asym --loss-type asymmetric --over-penalty 1.0 --under-penalty 2.0
aam train "${REQ[@]}" --output-dir ug/lossconfig --loss-config '{"0": "mse"}'
aam train "${REQ[@]}" --output-dir ug/cat --categorical-columns location,season --categorical-embed-dim 16 --categorical-fusion concat
"$BIN" train --categorical-help > /dev/null && echo "+ aam-rs train --categorical-help" >&2
aam train "${REQ[@]}" --output-dir ug/cond --categorical-columns location,season --conditional-output-scaling location
aam pretrain --table "$TABLE" --unifrac-matrix "$NPY" --output-dir ug/pretrain2 --epochs 2
aam train "${REQ[@]}" --output-dir ug/staged --pretrained-encoder ug/pretrain2/checkpoints/best_model.pt --freeze-base --categorical-columns location,season
aam pretrain --table "$TABLE" --unifrac-matrix "$NPY" --output-dir ug/mem --batch-size 2 --gradient-accumulation-steps 16 --token-limit 256 --epochs 2
# The baseline on the split of a `train` run (the user guide names output/train's).
"$BIN" rf-baseline --table "$TABLE" --metadata "$TSV" --metadata-column $COL \
  --train-samples ug/single/train_samples.txt --val-samples ug/single/val_samples.txt --output rf_predictions.tsv 2> last.log
echo "+ aam-rs rf-baseline: $(grep -c . rf_predictions.tsv) lines, $(ls rf_predictions.png)" >&2
for c in pretrain train predict rf-baseline; do "$BIN" $c --help > /dev/null; done
fi
# The user guide's larger model and multi-GPU fragments.
if part scale; then
REQ=(--table "$TABLE" --unifrac-matrix "$NPY" --metadata meta.tsv --metadata-column $COL --epochs 2)
aam pretrain --table "$TABLE" --unifrac-matrix "$NPY" --output-dir ug/medium --embedding-dim 768 --attention-heads 6 --attention-layers 4 \
  --batch-size 2 --gradient-accumulation-steps 16 --data-parallel --epochs 1
aam pretrain --table "$TABLE" --unifrac-matrix "$NPY" --output-dir ug/fsdp --fsdp --epochs 1
aam pretrain --table "$TABLE" --unifrac-matrix "$NPY" --output-dir ug/dp --data-parallel --epochs 1
aam train "${REQ[@]}" --output-dir ug/ddp --distributed
fi
echo "the documented examples of: $PARTS ran to completion" >&2
