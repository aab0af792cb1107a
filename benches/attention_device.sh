#!/usr/bin/env bash
# The fused attention kernels on a GPU machine (docs/gpu-benchmarks.md): their parity tests on
# CUDA, then `attention-bench` beside PyTorch SDPA (`pt_attention.py`) in the same call.
# Binaries built on the build machine and carried in .carry/gpu/ (xz):
#   CUDARC_CUDA_VERSION=12080 cargo build --profile device -p aam-benches --features cuda \
#     --bin attention-bench
#   CUDARC_CUDA_VERSION=12080 cargo test --profile device -p aam-kernels --features cuda,ndarray \
#     --test kernels --no-run   # prints its path
#   xz -c <each> > .carry/gpu/{attention-bench,kernels}.xz
# The kernel crate's tests are one binary; its suites run here by module: fused_parity::
# runs every kernel the plan can pick on CUDA: the default plan, and through
# `KernelChoice` rows split over lanes, head dims in two parts, the separate dQ and dK/dV
# backward, and CUDA cores only (the row forward, the merged backward).
# Run from the repository root with carry [".carry/gpu"]. Env: PARITY (1: run the parity
# tests), PARITY_TIMEOUT (s per run, default 280: NVRTC compiles a kernel per shape, dtype and
# dropout setting), PARITY_THREADS (tests at once, default 8: their kernels compile in
# parallel), PARITY_PARALLEL (1: the three suites at once; on an H200 PARITY_THREADS=6 with
# PARITY_TIMEOUT=300 finished them in 150-180 s), PARITY_FILTER (filter of the
# parity run, default fused_parity::), OPS_FILTER
# (default ops::packed_attention::), WGPU_PARITY (1: also run fused_parity:: of the test
# binary built with --features wgpu,ndarray, carried as .carry/gpu/kernels_wgpu.xz, on the
# GPU through Vulkan; carry .gl too: the Vulkan
# loader's .deb packages), BENCH (1: run the timings), BENCHES (default "attention-bench":
# attention-bench builds .carry/gpu/<name>.xz, timed in turn ROUNDS times (default 1), so that
# two builds are compared interleaved in one call), KERNELS (e.g. "lanes=1 cuda-cores": also
# time the first bench with each AAM_BENCH_KERNELS setting, one run each), REGISTERS (1: after
# the timings, registers and spills of each compiled CUDA kernel, from CubeCL's PTX cache, by
# benches/ptx_registers.py), PT (0: leave out PyTorch's SDPA timings).
# Writes to $OUT: fused_parity{,_wgpu}.log, half_precision.log, ops.log,
# rs_attention[_<bench>][_r<round>].jsonl, rs_attention_kernels_<setting>.jsonl,
# pt_attention.jsonl, registers.jsonl.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/gpu
BENCHES=${BENCHES:-attention-bench}
for b in $BENCHES kernels kernels_wgpu; do
  [ -f ".carry/gpu/$b.xz" ] && xz -dc ".carry/gpu/$b.xz" > "/tmp/gpu/$b" && chmod +x "/tmp/gpu/$b"
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
status=0
# One suite of the carried CUDA test binary: its log's name, its title, a pattern of extra
# lines to show, and the test filter.
cuda_test() {
  [ -x /tmp/gpu/kernels ] || return 0
  echo "== $1 ($2)"
  timeout "${PARITY_TIMEOUT:-280}" /tmp/gpu/kernels "$4" --nocapture --test-threads "${PARITY_THREADS:-8}" \
    > "$OUT/$1.log" 2>&1
  rc=$?; [ $rc -eq 0 ] || status=1
  grep -E "^test .*(ok|FAILED)$|panicked|test result${3:+|$3}" "$OUT/$1.log" | cut -c1-200 | tail -30
  echo "rc=$rc"
}
if [ "${PARITY:-1}" = 1 ]; then
  # The three suites at once (PARITY_PARALLEL=1; their NVRTC compiles share the cores) or in turn.
  suites=(
    'cuda_test fused_parity "cuda: every kernel of the plan, and each fallback by KernelChoice" "" "${PARITY_FILTER:-fused_parity::}"'
    'cuda_test half_precision "cuda: tensor-core forward and gradients against the f32 kernel" "BF16 \(151" half_precision::'
    'cuda_test ops "cuda: ${OPS_FILTER:-ops::packed_attention::}" "BF16 .*t=151" "${OPS_FILTER:-ops::packed_attention::}"'
  )
  if [ "${PARITY_PARALLEL:-0}" = 1 ]; then
    pids=()
    for i in 0 1 2; do (eval "${suites[$i]}"; exit $status) > "/tmp/gpu/suite_$i.txt" 2>&1 & pids+=($!); done
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    cat /tmp/gpu/suite_{0,1,2}.txt
  else
    for suite in "${suites[@]}"; do eval "$suite"; done
  fi
fi
if [ "${WGPU_PARITY:-0}" = 1 ]; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
  if ! ls /usr/share/vulkan/icd.d/nvidia_icd.json /etc/vulkan/icd.d/nvidia_icd.json >/dev/null 2>&1; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  fi
  echo "== fused_parity (wgpu, Vulkan)"
  timeout "${PARITY_TIMEOUT:-280}" /tmp/gpu/kernels_wgpu fused_parity:: --nocapture --test-threads "${PARITY_THREADS:-8}" \
    > "$OUT/fused_parity_wgpu.log" 2>&1
  rc=$?; [ $rc -eq 0 ] || status=1
  grep -E "^test .*(ok|FAILED)$|panicked|test result|adapter|Adapter" "$OUT/fused_parity_wgpu.log" | cut -c1-200 | tail -30
  echo "rc=$rc"
fi
[ "${BENCH:-1}" = 1 ] || exit $status
first=${BENCHES%% *}
for round in $(seq "${ROUNDS:-1}"); do
  for b in $BENCHES; do
    name=rs_attention; [ "$b" != attention-bench ] && name="${name}_${b#attention-bench-}"
    [ "${ROUNDS:-1}" -gt 1 ] && name="${name}_r$round"
    echo "== $b (aam-rs), round $round"
    "/tmp/gpu/$b" > "$OUT/$name.jsonl" 2>&1 || status=1
    grep '"fused"' "$OUT/$name.jsonl"
  done
done
for setting in ${KERNELS:-}; do
  echo "== $first, AAM_BENCH_KERNELS=$setting"
  AAM_BENCH_KERNELS=$setting "/tmp/gpu/$first" > "$OUT/rs_attention_kernels_${setting//[=,]/_}.jsonl" 2>&1 || status=1
  grep '"fused"' "$OUT/rs_attention_kernels_${setting//[=,]/_}.jsonl"
done
if [ "${PT:-1}" = 1 ]; then
  echo "== PyTorch SDPA (pt_attention.py)"
  PYTHONUNBUFFERED=1 python3 benches/pt_attention.py > "$OUT/pt_attention.jsonl" 2>&1 || status=1
  grep -v Warning "$OUT/pt_attention.jsonl" | grep '^{'
fi
if [ "${REGISTERS:-0}" = 1 ]; then
  echo "== registers (ptxas -v on CubeCL's cached PTX)"
  python3 benches/ptx_registers.py . --keep "$OUT/ptx" > "$OUT/registers.jsonl" 2>&1 || status=1
  cat "$OUT/registers.jsonl"
fi
exit $status
