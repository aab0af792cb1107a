#!/usr/bin/env bash
# Release tarballs of the `aam-rs` binary, one per backend set, for x86_64 Linux:
#   cpu   ndarray + candle + wgpu (Vulkan; lavapipe or a GPU's driver at run time)
#   cuda  ndarray + cuda + fusion + wgpu (NVIDIA driver and NVRTC at run time)
#   rocm  ndarray + rocm + fusion (HIP and hipRTC at run time; build where `hipconfig` is the
#         cluster's ROCm, or the newest HIP bindings are chosen; docs/backends.md)
# Each lands in dist/ as aam-rs-<version>-<set>-x86_64-linux.tar.gz with the stripped binary,
# LICENSE and README.md, and a .sha256 beside it (`sha256sum -c` checks it).
#
# Usage (from anywhere in the clone):  packaging/release.sh [cpu] [cuda] [rocm]   (default: cpu)
# CUDA builds need `nvcc` on PATH or CUDARC_CUDA_VERSION (12080 = CUDA 12.8; set here when absent).
# CARGO_TARGET_DIR is honoured, so one warm target folder serves every set.
set -euo pipefail
cd "$(dirname "$0")/.."
sets=("$@"); [ ${#sets[@]} -gt 0 ] || sets=(cpu)
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
target=${CARGO_TARGET_DIR:-target}
mkdir -p dist
for set in "${sets[@]}"; do
  case "$set" in
    cpu)  features="candle,wgpu" ;;
    cuda) features="cuda,fusion,wgpu"; export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-12080} ;;
    rocm) features="rocm,fusion" ;;
    *) echo "unknown backend set $set (cpu, cuda, rocm)" >&2; exit 2 ;;
  esac
  echo "== $set: cargo build --locked --profile device -p aam-cli --features $features" >&2
  cargo build --locked --profile device -p aam-cli --features "$features"
  name="aam-rs-$version-$set-x86_64-linux"
  stage=$(mktemp -d)
  mkdir "$stage/$name"
  cp "$target/device/aam-rs" LICENSE README.md "$stage/$name/"
  "$stage/$name/aam-rs" --version >/dev/null
  tar -C "$stage" -czf "dist/$name.tar.gz.tmp" "$name"
  mv "dist/$name.tar.gz.tmp" "dist/$name.tar.gz"
  (cd dist && sha256sum "$name.tar.gz" > "$name.tar.gz.sha256")
  rm -rf "$stage"
  echo "dist/$name.tar.gz ($(du -h "dist/$name.tar.gz" | cut -f1)), dist/$name.tar.gz.sha256" >&2
done
