#!/usr/bin/env bash
# Run on the device machine from the repository root (carry [".carry/tch"]): the tch (libtorch) binaries built on
# the build machine against torch 2.11.0's own libtorch (PyPI wheel, cu130), with
#   LIBTORCH=<wheel>/torch LIBTORCH_BYPASS_VERSION_CHECK=1 \
#   RUSTFLAGS="-C link-arg=-Wl,--allow-shlib-undefined" CARGO_TARGET_DIR=/work/tch-target
#   cargo build --profile device -p aam-cli --features tch
#   cargo test  --profile device -p aam-tests --features tch --test parity --no-run
# They link libtorch_cuda.so, libtorch_cpu.so and libc10.so (no version in the soname) and find them
# through LD_LIBRARY_PATH = the device Python's torch/lib; those libraries find NVIDIA's own
# (site-packages/nvidia/...) through their RPATH $ORIGIN/../../nvidia/*/lib.
# Writes tch_backends.txt, diagnose_tch-gpu.{txt,json} and backend_parity_tch.log to $OUT.
# Extra arguments go to the test binary. Binaries go gzipped to .carry/tch/{aam-rs,parity}.gz.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
HERE=.carry/tch
mkdir -p /tmp/tch
for b in aam-rs parity; do gunzip -c "$HERE/$b.gz" > "/tmp/tch/$b" && chmod +x "/tmp/tch/$b"; done

PY=${PYTHON:-python3}
TORCH_DIR=$("$PY" -c 'import torch,os;print(os.path.dirname(torch.__file__))') || { echo "no torch in $PY"; exit 1; }
"$PY" -c 'import torch;print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
SITE=$(dirname "$TORCH_DIR")
LIBS="$TORCH_DIR/lib"
# The torch libraries' RPATH already points at these; listed too in case the layout differs.
for d in "$SITE"/nvidia/*/lib; do [ -d "$d" ] && LIBS="$LIBS:$d"; done
export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The binaries already have libtorch_cuda.so as NEEDED (burn-tch's dummy_cuda_dependency), so CUDA is
# registered without LD_PRELOAD; TCH_PRELOAD=1 forces it anyway.
if [ "${TCH_PRELOAD:-0}" = 1 ]; then export LD_PRELOAD="$TORCH_DIR/lib/libtorch_cuda.so"; fi
export TCH_PRINT_CUDA_INIT_ERROR=1

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "== ldd"
ldd /tmp/tch/aam-rs | grep -E "torch|c10|cuda|not found"
echo "== aam-rs backends"
/tmp/tch/aam-rs backends 2>&1 | tee "$OUT/tch_backends.txt"
status=${PIPESTATUS[0]}
echo "rc=$status"

echo "== diagnose attention --backend tch-gpu"
/tmp/tch/aam-rs diagnose attention --backend tch-gpu --json-out "$OUT/diagnose_tch-gpu.json" \
  > "$OUT/diagnose_tch-gpu.txt" 2>&1
rc=$?; [ $rc -eq 0 ] || status=1
grep -v " ok$" "$OUT/diagnose_tch-gpu.txt" | cut -c1-220 | head -30
echo "rc=$rc"

echo "== backend_parity (tch CPU and tch_gpu)"
start=$(date +%s)
CARGO_MANIFEST_DIR="$PWD/tests" /tmp/tch/parity --include-ignored backend_parity::tch --nocapture --test-threads 1 "$@" \
  > "$OUT/backend_parity_tch.log" 2>&1
rc=$?; [ $rc -eq 0 ] || status=1
grep -E "^test |max|result|panicked|error" "$OUT/backend_parity_tch.log" | cut -c1-220 | tail -40
echo "rc=$rc wall=$(( $(date +%s) - start ))s"
exit $status
