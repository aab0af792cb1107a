#!/usr/bin/env bash
# The training step's dense matmuls on a GPU machine: `matmul-bench` (Burn's fusion
# backend and the plain CubeCL backend on CUDA) beside PyTorch (benches/pt_matmul.py) in one call.
#
# Run from the repository root on the GPU machine (docs/gpu-benchmarks.md), with carry [".carry/gpu"]:
#   .carry/gpu/matmul-bench.xz   CUDARC_CUDA_VERSION=12080 cargo build --profile device \
#                                -p aam-benches --bin matmul-bench --features matmul; xz
#   .carry/gpu/cache/            optional: CubeCL's kernel cache (benches/kernel_cache.sh)
# Env: ROWS, SPLITS (as pt_matmul.py), CUBECL_AUTOTUNE_LEVEL (default minimal),
#      AUTOTUNE_LOG=1 (CubeCL's autotune log, every candidate's time, to $OUT/autotune.log).
# Writes $OUT/matmul.jsonl, $OUT/cache.txz.*.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/bin
xz -dc .carry/gpu/matmul-bench.xz > /tmp/bin/matmul-bench; chmod +x /tmp/bin/matmul-bench
source benches/kernel_cache.sh; restore_kernel_cache; trap save_kernel_cache EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
export CUBECL_AUTOTUNE_LEVEL=${CUBECL_AUTOTUNE_LEVEL:-minimal}
if [ "${AUTOTUNE_LOG:-0}" = 1 ]; then
  printf '[autotune.logger]\nlevel = "full"\nfile = "%s/autotune.log"\n' "$OUT" > cubecl.toml
fi
status=0
ROWS=${ROWS:-62976}; SPLITS=${SPLITS:-8,16,32,64}
timeout "${BENCH_TIMEOUT:-400}" /tmp/bin/matmul-bench --rows "$ROWS" --splits "$SPLITS" \
  | tee "$OUT/matmul.jsonl" || status=1
ROWS=$ROWS SPLITS=$SPLITS timeout 200 python3 benches/pt_matmul.py | tee -a "$OUT/matmul.jsonl" || status=1
python3 - "$OUT/matmul.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print(f"{'shape':>16} {'op':>28} {'split':>5} " + " ".join(f"{s:>12}" for s in ["plain", "fused", "torch_f32", "torch_tf32"]))
keys = sorted({(r["shape"], r["op"], r["split"] or 0) for r in rows}, key=lambda k: (k[0], k[1], k[2]))
for shape, op, split in keys:
    cell = {}
    for r in rows:
        if (r["shape"], r["op"], r["split"] or 0) == (shape, op, split):
            cell[r["backend"] if r["side"] == "aam-rs" else r["side"]] = r["pipelined_ms"]
    print(f"{shape:>16} {op:>28} {split:>5} " + " ".join(f"{cell.get(s, float('nan')):>9.3f} ms" for s in ["plain", "fused", "torch_f32", "torch_tf32"]))
PY
exit $status
