#!/usr/bin/env bash
# Times `aam-rs unifrac` beside `ssu` (Debian's unifrac-tools, fp64, no GPU)
# on the same cores in one run: oral2550 (2,537 samples, its FastTree tree)
# and a synthetic table of SAMPLES samples drawn from it on the same tree
# (unifrac-bench synth), unweighted and weighted_normalized; checks that the
# two matrices agree. Prints one line per run; RESULTS.md keeps them.
#
#   cargo build --release -p aam-cli -p aam-benches --bin aam-rs --bin unifrac-bench
#   THREADS=2 SAMPLES=20000 benches/unifrac.sh
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-$(nproc)}
SAMPLES=${SAMPLES:-20000}
DATA=${DATA:-../shared/data/oral2550}
BIN=${BIN:-target/release}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
tree=$DATA/tree.fasttree-midpoint.nwk
# Wall seconds and peak RSS (MiB) of a command, into file $1 (python3: no GNU time needed).
timed() {
  local out=$1; shift
  python3 - "$out" "$@" <<'PY'
import resource, subprocess, sys, time
start = time.time()
rc = subprocess.run(sys.argv[2:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
wall = time.time() - start
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024
open(sys.argv[1], "w").write(f"{wall:.2f} {peak}\n")
sys.exit(rc)
PY
}
"$BIN/unifrac-bench" synth --table "$DATA/oral_2550.biom" --samples "$SAMPLES" --output "$WORK/synth.biom"
echo "date $(date -u +%F) cpu \"$(sed -n 's/^model name[^:]*: *//p' /proc/cpuinfo | head -1)\" threads $THREADS ssu $(dpkg-query -W -f='${Version}' unifrac-tools 2>/dev/null || echo carried)"
for table in "$DATA/oral_2550.biom" "$WORK/synth.biom"; do
  for method in unweighted weighted_normalized; do
    timed "$WORK/t_ours" "$BIN/aam-rs" unifrac --table "$table" --tree "$tree" \
      --method "$method" --threads "$THREADS" --output "$WORK/ours.h5"
    OMP_NUM_THREADS=$THREADS UNIFRAC_USE_GPU=N timed "$WORK/t_ssu" \
      ssu -i "$table" -t "$tree" -m "${method}_fp64" -o "$WORK/ssu.h5" --format hdf5_fp64 --pcoa 0
    read -r ours_s ours_mib < "$WORK/t_ours"
    read -r ssu_s ssu_mib < "$WORK/t_ssu"
    diff=$("$BIN/unifrac-bench" compare "$WORK/ours.h5" "$WORK/ssu.h5")
    ratio=$(python3 -c "print(f'{$ssu_s / $ours_s:.2f}')")
    echo "$(basename "$table") $method aam-rs ${ours_s}s ${ours_mib}MiB ssu ${ssu_s}s ${ssu_mib}MiB speedup $ratio max_abs_diff_fp32 $diff"
    rm -f "$WORK/ours.h5" "$WORK/ssu.h5"
  done
done
