#!/usr/bin/env bash
# Times `aam-rs unifrac` beside `ssu` (Debian's unifrac-tools, fp64, no GPU)
# on the same cores in one run: oral2550 (2,537 samples, its FastTree tree)
# and a synthetic table of SAMPLES samples drawn from it on the same tree
# (unifrac-bench synth), unweighted and weighted_normalized; checks that the
# two matrices agree. Prints one line per run; RESULTS.md keeps them.
#
#   cargo build --release -p aam-cli -p aam-benches --bin aam-rs --bin unifrac-bench
#   THREADS=2 SAMPLES=20000 benches/unifrac.sh
# GPU=cuda (or rocm, wgpu) times `aam-rs unifrac --gpu $GPU` instead of its
# CPU path (an aam-rs built with that feature); METHODS picks the methods;
# VAW=1 runs them variance adjusted (`--variance-adjusted`, `ssu --vaw`).
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-$(nproc)}
SAMPLES=${SAMPLES:-20000}
DATA=${DATA:-../shared/data/oral2550}
BIN=${BIN:-target/release}
GPU=${GPU:-}
METHODS=${METHODS:-unweighted weighted_normalized}
vaw_ours=(); vaw_ssu=(); vaw_label=""
[ "${VAW:-0}" = 1 ] && vaw_ours=(--variance-adjusted) && vaw_ssu=(--vaw) && vaw_label="+vaw"
ours_flags=(--threads "$THREADS")
[ -n "$GPU" ] && ours_flags=(--gpu "$GPU")
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
# SAMPLES=0: oral2550 only. SYNTH: a synthetic table made before, reused.
tables=("$DATA/oral_2550.biom")
if [ "$SAMPLES" -gt 0 ]; then
  SYNTH=${SYNTH:-$WORK/synth.biom}
  [ -f "$SYNTH" ] || "$BIN/unifrac-bench" synth --table "$DATA/oral_2550.biom" --samples "$SAMPLES" --output "$SYNTH"
  tables+=("$SYNTH")
fi
[ -n "$GPU" ] && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/gpu /' || true
echo "date $(date -u +%F) aam-rs ${GPU:+--gpu $GPU} cpu \"$(sed -n 's/^model name[^:]*: *//p' /proc/cpuinfo | head -1)\" threads $THREADS ssu $(dpkg-query -W -f='${Version}' unifrac-tools 2>/dev/null || echo carried)"
for table in "${tables[@]}"; do
  for method in $METHODS; do
    # generalized: alpha 0.5 (at 1 it is weighted_normalized).
    alpha_ours=(); alpha_ssu=()
    [ "$method" = generalized ] && alpha_ours=(--alpha 0.5) && alpha_ssu=(-a 0.5)
    timed "$WORK/t_ours" "$BIN/aam-rs" unifrac --table "$table" --tree "$tree" \
      --method "$method" "${alpha_ours[@]}" "${vaw_ours[@]}" "${ours_flags[@]}" --output "$WORK/ours.h5"
    OMP_NUM_THREADS=$THREADS UNIFRAC_USE_GPU=N timed "$WORK/t_ssu" \
      ssu -i "$table" -t "$tree" -m "${method}_fp64" "${alpha_ssu[@]}" "${vaw_ssu[@]}" -o "$WORK/ssu.h5" --format hdf5_fp64 --pcoa 0
    read -r ours_s ours_mib < "$WORK/t_ours"
    read -r ssu_s ssu_mib < "$WORK/t_ssu"
    diff=$("$BIN/unifrac-bench" compare "$WORK/ours.h5" "$WORK/ssu.h5")
    ratio=$(python3 -c "print(f'{$ssu_s / $ours_s:.2f}')")
    echo "$(basename "$table") $method$vaw_label aam-rs ${ours_s}s ${ours_mib}MiB ssu ${ssu_s}s ${ssu_mib}MiB speedup $ratio max_abs_diff $diff"
    rm -f "$WORK/ours.h5" "$WORK/ssu.h5"
  done
done
