#!/usr/bin/env bash
# benches/unifrac.sh on the device machine's CPU cores (no GPU is used): the
# machine has no Rust and no ssu, so both come carried from the build machine
# in .carry/unifrac/ (made by `benches/unifrac_device.sh pack` here):
#   aam-rs.xz, unifrac-bench.xz  release builds (CPU only)
#   ssu.tar.xz                   /usr/bin/ssu and the libraries it loads
#   oral_2550.biom.xz, tree.nwk.xz
# Run it through the device tool: `THREADS=16 SAMPLES=20000 bash benches/unifrac_device.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=.carry/unifrac
# `pack-ssu`: only ssu and its libraries (benches/unifrac_gpu_device.sh uses it too).
if [ "${1:-}" = pack ] || [ "${1:-}" = pack-ssu ]; then
  mkdir -p "$CARRY"
  libs=$(ldd /usr/bin/ssu | awk '$3 ~ /^\// {print $3}' | grep -v -E '/(libc|libm|libpthread|libdl|librt)\.so')
  tmp=$(mktemp -d); mkdir -p "$tmp/bin" "$tmp/lib"
  cp /usr/bin/ssu "$tmp/bin/"; for l in $libs; do cp -L "$l" "$tmp/lib/"; done
  tar -C "$tmp" -cJf "$CARRY/ssu.tar.xz" bin lib; rm -rf "$tmp"
  [ "$1" = pack-ssu ] && exit 0
  xz -T2 -9 -c target/release/aam-rs > "$CARRY/aam-rs.xz"
  xz -T2 -9 -c target/release/unifrac-bench > "$CARRY/unifrac-bench.xz"
  xz -9 -c ../shared/data/oral2550/oral_2550.biom > "$CARRY/oral_2550.biom.xz"
  xz -9 -c ../shared/data/oral2550/tree.fasttree-midpoint.nwk > "$CARRY/tree.nwk.xz"
  du -sh "$CARRY"
  exit 0
fi
W=$(mktemp -d)
mkdir -p "$W/bin" "$W/data/oral2550"
xz -dc "$CARRY/aam-rs.xz" > "$W/bin/aam-rs"
xz -dc "$CARRY/unifrac-bench.xz" > "$W/bin/unifrac-bench"
chmod +x "$W/bin/"*
tar -C "$W" -xJf "$CARRY/ssu.tar.xz"
xz -dc "$CARRY/oral_2550.biom.xz" > "$W/data/oral2550/oral_2550.biom"
xz -dc "$CARRY/tree.nwk.xz" > "$W/data/oral2550/tree.fasttree-midpoint.nwk"
export PATH="$W/bin:$PATH" LD_LIBRARY_PATH="$W/lib"
# dpkg on the device does not know the carried ssu: name its version here.
echo "ssu: Debian unifrac-tools 1.2-2 (carried)"
BIN="$W/bin" DATA="$W/data/oral2550" bash benches/unifrac.sh
