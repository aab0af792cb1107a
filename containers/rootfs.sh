#!/usr/bin/env bash
# A CPU image of aam-rs made without a container engine or registry: a Debian bookworm root
# filesystem (debootstrap, minbase) with the binary and Mesa's Vulkan driver (wgpu on lavapipe),
# packed as dist/aam-rs-<version>-cpu-rootfs.tar.gz. Load it with
#   docker import dist/aam-rs-<version>-cpu-rootfs.tar.gz aam-rs:cpu   (podman import likewise)
# or unpack it and `apptainer build aam-rs-cpu.sif <folder>/`. The script then checks the image
# in a chroot: `aam-rs backends`, and a one-epoch pretrain on the bundled demo that must leave a
# checkpoint.
#
# Usage (root; apt-get install debootstrap):  containers/rootfs.sh
# Env: BIN (the aam-rs binary to put in; default: dist's cpu release, built by
#      packaging/release.sh cpu when absent), MIRROR (default http://deb.debian.org/debian).
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
name="aam-rs-$version-cpu"
if [ -z "${BIN:-}" ]; then
  [ -f "dist/$name-x86_64-linux.tar.gz" ] || packaging/release.sh cpu
  tar -xzf "dist/$name-x86_64-linux.tar.gz" -C dist
  BIN="dist/$name-x86_64-linux/aam-rs"
fi
command -v debootstrap >/dev/null || { echo "needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
work=$(mktemp -d); root="$work/rootfs"
cleanup() { umount "$root/proc" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
debootstrap --variant=minbase --include=libvulkan1,mesa-vulkan-drivers bookworm "$root" \
  "${MIRROR:-http://deb.debian.org/debian}" > "$work/debootstrap.log" 2>&1 \
  || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
install -D -m 755 "$BIN" "$root/usr/local/bin/aam-rs"
install -D -m 644 LICENSE "$root/usr/share/doc/aam-rs/LICENSE"
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
mkdir -p dist
tar -C "$root" --numeric-owner -czf "dist/$name-rootfs.tar.gz.tmp" .
mv "dist/$name-rootfs.tar.gz.tmp" "dist/$name-rootfs.tar.gz"
(cd dist && sha256sum "$name-rootfs.tar.gz" > "$name-rootfs.tar.gz.sha256")
echo "dist/$name-rootfs.tar.gz: $(du -h "dist/$name-rootfs.tar.gz" | cut -f1)"

# The check, in the unpacked tree (the packed image holds no demo data).
mount -t proc proc "$root/proc" 2>/dev/null || true
mkdir -p "$root/demo"
cp crates/data/demo/demo.biom crates/data/demo/unifrac.unweighted.h5 "$root/demo/"
chroot "$root" /usr/local/bin/aam-rs --version
chroot "$root" /usr/local/bin/aam-rs backends
chroot "$root" /usr/local/bin/aam-rs pretrain --table /demo/demo.biom \
  --unifrac-matrix /demo/unifrac.unweighted.h5 --rarefy-depth 1000 --max-bp 100 --epochs 1 \
  --embedding-dim 32 --attention-heads 2 --attention-layers 1 --token-limit 64 --batch-size 8 \
  --output-dir /demo/run 2>&1 | tail -2
test -s "$root/demo/run/checkpoints/best.safetensors"
echo "the image runs aam-rs: demo pretrain checkpoint written"
