#!/usr/bin/env bash
# Data pipeline, aam-rs vs Python, in one run: load + rarefy + tokenise + one
# epoch of batches on a real study (default: oral2550, 2,537 samples x 5,574
# ASVs, rarefied to 1,000 reads, batch 8, token_limit 1024, max_bp 150).
#
#   benches/data_pipeline.sh [DATA_DIR] [REPS]
#
# Needs python3 with biom-format, h5py and numpy (pip install biom-format h5py).
# Prints every repetition as JSON, then the median of each phase and the ratio
# aam-rs / Python (lower is better), for both Python variants (see
# data_pipeline.py). Rust runs with one batch worker, like the single Python process.
set -euo pipefail
cd "$(dirname "$0")/.."
data="${1:-../shared/data/oral2550}"
reps="${2:-5}"
table="$data/oral_2550.biom"; matrix="$data/unifrac.unweighted.h5"
cargo build --release --quiet -p aam-benches --bin data-bench
out="$(mktemp)"
echo "# $(date -u +%FT%TZ) $(uname -m) $(nproc) cores; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
./target/release/data-bench "$table" "$matrix" --reps "$reps" --workers 1 | tee -a "$out"
python3 benches/data_pipeline.py "$table" "$matrix" --reps "$reps" | tee -a "$out"
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
phases = ["load_table_s", "load_matrix_s", "rarefy_s", "tokenise_s", "batch_epoch_s", "total_s"]
by = {}
for r in rows:
    by.setdefault(r["impl"], []).append(r)
med = {k: {p: statistics.median(r[p] for r in v) for p in phases} for k, v in by.items()}
checks = {k: (v[0]["samples"], v[0]["asvs"], v[0]["batches"], v[0]["count_sum"]) for k, v in by.items()}
assert len(set(checks.values())) == 1, f"implementations disagree on the data: {checks}"
print("\nmedian seconds (samples, ASVs, batches, total counts = %s)" % (checks["aam-rs"],))
print("%-18s" % "phase" + "".join("%18s" % k for k in med))
for p in phases:
    print("%-18s" % p + "".join("%18.4f" % med[k][p] for k in med))
for k in med:
    if k != "aam-rs":
        print(f"ratio aam-rs / {k}: {med['aam-rs']['total_s'] / med[k]['total_s']:.3f} (total), "
              f"{med['aam-rs']['batch_epoch_s'] / med[k]['batch_epoch_s']:.3f} (batching)")
PY
