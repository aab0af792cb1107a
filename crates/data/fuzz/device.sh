#!/usr/bin/env bash
# The fuzz targets on the device machine's CPU cores (no GPU is used; the
# machine has no Rust): binaries built here with `run.sh`'s settings and the
# seed corpora come in .carry/fuzz/fuzz.tar.xz, made by
#   crates/data/fuzz/device.sh pack        (after `cargo +nightly fuzz build -O` and seeding)
# and, on the device, through the device tool:
#   SECONDS_PER_TARGET=560 FORK=2 bash crates/data/fuzz/device.sh
# runs every target at once (FORK worker processes each) and leaves each
# target's log, final corpus and any crash under $OUT. A second run goes on
# from the first's corpus: copy its $OUT/corpus.tar.xz to .carry/fuzz/.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/../../.."
CARRY="$root/.carry/fuzz"
targets=(biom_json biom_hdf5 matrix_npy matrix_csv metadata_tsv newick samples_json)
if [ "${1:-}" = pack ]; then
  tmp=$(mktemp -d); mkdir -p "$tmp/bin" "$CARRY"
  for t in "${targets[@]}"; do
    # Debug info off (symbols kept: a crash's stack still names functions).
    strip --strip-debug -o "$tmp/bin/$t" "$here/target/x86_64-unknown-linux-gnu/release/$t"
  done
  cp -r "$here/corpus" "$tmp/corpus"
  XZ_OPT="-T2 -9" tar -C "$tmp" -cJf "$CARRY/fuzz.tar.xz" bin corpus; rm -rf "$tmp"
  du -sh "$CARRY"
  exit 0
fi
seconds="${SECONDS_PER_TARGET:-560}"
fork="${FORK:-2}"
out="${OUT:-$(mktemp -d)}"
W=$(mktemp -d)
tar -C "$W" -xJf "$CARRY/fuzz.tar.xz"
# A corpus a previous run left (its $OUT/corpus.tar.xz, put here) continues.
if [ -f "$CARRY/corpus.tar.xz" ]; then rm -rf "$W/corpus"; tar -C "$W" -xJf "$CARRY/corpus.tar.xz"; fi
nproc; uname -r
for t in "${targets[@]}"; do
  mkdir -p "$W/corpus/$t" "$out/artifacts/$t"
  ( cd "$W" && "./bin/$t" -fork="$fork" -ignore_crashes=1 "corpus/$t" \
      -max_total_time="$seconds" -rss_limit_mb=4096 -max_len=65536 -timeout=30 \
      -artifact_prefix="$out/artifacts/$t/" >"$out/$t.log" 2>&1; echo "$t exit $?" >>"$out/$t.log" ) &
done
wait
for t in "${targets[@]}"; do
  echo "== $t: $(ls "$W/corpus/$t" | wc -l) corpus files, $(ls "$out/artifacts/$t" | wc -l) crash files"
  grep -E '^#[0-9]+: cov|exit|stat::|DONE|INFO: fuzzed' "$out/$t.log" | tail -n 4
done
tar -C "$W" -cJf "$out/corpus.tar.xz" corpus
