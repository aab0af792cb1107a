#!/usr/bin/env bash
# GPU checks on the device machine (docs/gpu-benchmarks.md): `aam-rs diagnose attention` on CUDA and
# on wgpu (Vulkan), then the cross-backend parity suite (tests/backend_parity.rs, module
# `backend_parity` of the `parity` test binary) on both, from
# binaries built on the build machine and carried:
#   CUDARC_CUDA_VERSION=12080 cargo build --profile device -p aam-cli --features cuda,wgpu
#   CUDARC_CUDA_VERSION=12080 cargo test --profile device -p aam-tests --features cuda,wgpu \
#     --test parity --no-run          # prints the test binary's path
#   gzip -c <each> > .carry/gpu/{aam-rs,parity}.gz
# and the Vulkan loader debs in .gl/ (device README). Run from the repository root with
# carry [".carry/gpu", ".gl"]; env BACKENDS (default "cuda wgpu") and PARITY (1: also run the
# parity suite, 0: only the diagnostic). Writes diagnose_<backend>.{txt,json} and backend_parity.log to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
if ! ls /usr/share/vulkan/icd.d/nvidia_icd.json /etc/vulkan/icd.d/nvidia_icd.json >/dev/null 2>&1; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
# CubeCL's autotune results and compiled kernels (target/ under the repository root) go back
# in $OUT/cache.txz.* (benches/kernel_cache.sh); carried in .carry/gpu/cache/, a later call skips the tuning and the
# JIT (the same convention as benches/step_device.sh and benches/pretrain_device.sh).
source benches/kernel_cache.sh; restore_kernel_cache; trap save_kernel_cache EXIT
mkdir -p /tmp/gpu
bins=aam-rs; [ "${PARITY:-1}" = 1 ] && bins="aam-rs parity"
for b in $bins; do gunzip -c ".carry/gpu/$b.gz" > "/tmp/gpu/$b" && chmod +x "/tmp/gpu/$b"; done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
/tmp/gpu/aam-rs backends
status=0
for backend in ${BACKENDS-cuda wgpu}; do
  echo "== diagnose attention --backend $backend"
  start=$(date +%s)
  timeout "${DIAGNOSE_TIMEOUT:-280}" /tmp/gpu/aam-rs diagnose attention --backend "$backend" \
    --json-out "$OUT/diagnose_$backend.json" ${DIAGNOSE_ARGS:-} > "$OUT/diagnose_$backend.txt" 2>&1
  rc=$?; [ $rc -eq 0 ] || status=1
  grep -v " ok$" "$OUT/diagnose_$backend.txt" | cut -c1-220 | head -40
  echo "rc=$rc wall=$(( $(date +%s) - start ))s"
done
if [ "${PARITY:-1}" = 1 ]; then
  echo "== backend_parity (cuda, wgpu)"
  CARGO_MANIFEST_DIR="$PWD/tests" timeout "${PARITY_TIMEOUT:-400}" /tmp/gpu/parity backend_parity:: \
    --nocapture --test-threads 1 > "$OUT/backend_parity.log" 2>&1
  rc=$?; [ $rc -eq 0 ] || status=1
  grep -E "^test |max|result" "$OUT/backend_parity.log" | cut -c1-200 | tail -40
  echo "rc=$rc"
fi
exit $status
