#!/usr/bin/env bash
# Seed and run the fuzz targets of aam-data's readers, the Newick reader
# (aam-unifrac) and serve's request body (cargo-fuzz, nightly toolchain).
#
#   crates/data/fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]
#
# Seeds come from ../shared/data (real tables, matrices and metadata, and the
# biom-format edge-case fixtures). Each target runs for SECONDS (default 600)
# on one core; its log goes to logs/<target>.log and a crash, if any, to
# artifacts/<target>/. Exits non-zero when any target found a crash.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
data="${AAM_SHARED_DATA:-$here/../../../../shared/data}"
seconds="${1:-600}"; shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(biom_json biom_hdf5 matrix_npy matrix_csv metadata_tsv newick samples_json)
cd "$here"
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
rustup toolchain list | grep -q nightly || rustup toolchain install nightly --profile minimal

seed() { # seed TARGET [SELECTOR_BYTE] FILE...
  local target="$1" selector="$2"; shift 2
  mkdir -p "corpus/$target"
  for f in "$@"; do
    [ -s "$f" ] || continue
    local out="corpus/$target/seed-$(basename "$(dirname "$f")")-$(basename "$f")"
    if [ -n "$selector" ]; then { printf "\\x$selector"; cat "$f"; } >"$out"; else cp "$f" "$out"; fi
  done
}
if [ -d "$data" ]; then
  seed biom_json "" "$data"/fixtures/biom-format/{min,rich}_sparse_otu_table.biom \
    <(head -c 20000 "$data/moving-pictures/table.v100-json.biom")
  seed biom_json "" "$data/moving-pictures/table.v100-json.biom"
  seed biom_hdf5 "" "$data"/fixtures/biom-format/*hdf5*.biom "$data"/fixtures/biom-format/test_data__*.biom \
    "$data"/fixtures/unifrac-tests/e1.biom "$data/fixtures/qiime-191-tt/otu-table.biom"
  # .npy: selector = number of IDs the caller supplies (9 for crawford, 34 for moving pictures).
  seed matrix_npy 09 "$data/fixtures/crawford/unifrac.unweighted.npy"
  seed matrix_npy 22 "$data/moving-pictures/unifrac.unweighted.npy"
  # .npz: the high bit of the selector picks the archive path.
  python3 - "$data" corpus/matrix_npy <<'PY' || echo "no numpy here: no .npz seeds"
import sys, numpy as np
data, out = sys.argv[1], sys.argv[2]
d = np.load(f"{data}/fixtures/crawford/unifrac.unweighted.npy")
ids = np.array(open(f"{data}/fixtures/crawford/unifrac.sample_ids.txt").read().split())
for name, kw in [("ids", dict(distances=d, sample_ids=ids)), ("plain", dict(distances=d.astype(np.float32)))]:
    np.savez(f"/tmp/seed_{name}.npz", **kw)
    open(f"{out}/seed-crawford-{name}.npz", "wb").write(bytes([0x80 | d.shape[0]]) + open(f"/tmp/seed_{name}.npz", "rb").read())
PY
  # Text matrices: selector bit 0 = 1 for tab-separated, 0 for comma-separated.
  seed matrix_csv 01 "$data/fixtures/qiime-191-tt/unweighted_unifrac_dm.txt"
  seed matrix_csv 00 <(tr '\t' ',' <"$data/fixtures/qiime-191-tt/weighted_unifrac_dm.txt")
  seed metadata_tsv "" "$data/fixtures/crawford/crawford.group.tsv" "$data/moving-pictures/sample-metadata.tsv" \
    <(head -n 40 "$data/oral2550/oral_2550_map.txt")
fi
seed metadata_tsv "" "$here/../demo/demo_map.txt"
seed newick "" "$here/../demo/tree.nwk"
[ -d "$data" ] && seed newick "" "$data"/fixtures/unifrac-tests/*.newick "$data"/fixtures/crawford/crawford.tre
mkdir -p corpus/samples_json
printf '%s' '{"samples": [{"id": "s1", "counts": {"TACGTAGGGGGCAAGCGTTATCCGG": 12, "TACGGAGGATCCGAGCGTTATCCGG": 3}}, {"id": "s2", "counts": [["TACGTAGGGGGCAAGCGTTATCCGG", 5]]}]}' \
  >corpus/samples_json/seed-request.json

status=0
mkdir -p logs
for target in "${targets[@]}"; do
  mkdir -p "artifacts/$target"
  echo "== $target: ${seconds}s"
  if cargo +nightly fuzz run -O "$target" "corpus/$target" -- \
      -max_total_time="$seconds" -rss_limit_mb=4096 -max_len=65536 -timeout=30 \
      -artifact_prefix="artifacts/$target/" >"logs/$target.log" 2>&1; then
    tail -n 3 "logs/$target.log"
  else
    status=1
    echo "!! $target failed; see logs/$target.log and artifacts/$target/"
    tail -n 30 "logs/$target.log"
  fi
done
exit $status
