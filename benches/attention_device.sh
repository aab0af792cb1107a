#!/usr/bin/env bash
# The fused attention kernels on a GPU machine (docs/gpu-benchmarks.md): their parity tests on
# CUDA, then `attention-bench` beside PyTorch SDPA (`pt_attention.py`) in the same call.
# Binaries built on the build machine and carried in .carry/gpu/ (xz):
#   CUDARC_CUDA_VERSION=12080 cargo build --profile device -p aam-benches --features cuda \
#     --bin attention-bench
#   CUDARC_CUDA_VERSION=12080 cargo test --profile device -p aam-kernels --features cuda,ndarray \
#     --test fused_parity --test fused_native_layout --test fused_separate_backward \
#     --test half_precision --test ops --no-run   # prints the test binaries' paths
#   xz -c <each> > .carry/gpu/{attention-bench,fused_parity,fused_native_layout,
#     fused_separate_backward,half_precision,ops}.xz (ops: OPS_FILTER, default packed_attention::)
# Run from the repository root with carry [".carry/gpu"]. Env: PARITY (1: run the parity
# tests), PARITY_LANES ("default 1": the default layout (on CUDA the register-tiled kernels
# wherever a head's keys fit a cube), and AAM_KERNEL_LANES=1 AAM_KERNEL_TILED=0 AAM_KERNEL_MMA=0, the scalar
# forward and merged backward at the ASV level's layout), PARITY_TIMEOUT (s per
# run, default 280: NVRTC compiles a kernel per shape, dtype and dropout setting), BENCH (1:
# run the timings), LANES_COMPARE (1: also time with AAM_KERNEL_LANES=1), MERGED_COMPARE (1: also
# time with AAM_KERNEL_MERGED_BACKWARD=0, the backward as two kernels), COMPARE_ENVS (e.g.
# "AAM_KERNEL_MERGED_PARTS=2": also time with each of these settings, one run each), PARITY_THREADS
# (tests at once, default 8: their kernels compile in parallel), PARITY_FILTER (test name
# filter), WGPU_PARITY (1: also run fused_parity, fused_lanes and fused_native_layout built with --features
# wgpu,ndarray, carried as .carry/gpu/<test>_wgpu.xz, on the GPU through
# Vulkan; carry .gl too: the Vulkan loader's .deb packages), REGISTERS (1: after the timings, registers and spills
# of each compiled CUDA kernel, from CubeCL's PTX cache, by benches/ptx_registers.py), TC_COMPARE
# (1: also time each of TC_DTYPES, default "bf16", alone, one process each, with each of
# TC_MODES, default "auto forward 0", as AAM_KERNEL_TC: tensor cores both ways, forward only,
# CUDA cores), TC_PLANES (e.g. "4 8": also bf16 with each
# AAM_KERNEL_TC_PLANES cap).
# Writes to $OUT: fused_parity{,_lanes1,_wgpu}.log, fused_native_layout{,_wgpu}.log, fused_lanes_wgpu.log,
# fused_separate_backward.log, rs_attention_separate.jsonl, rs_attention_<VAR>_<value>.jsonl,
# half_precision.log, ops.log, rs_attention{,_lanes1}.jsonl, rs_attention_tc_<dtype>_<mode>.jsonl,
# rs_attention_tc_planes<N>.jsonl, pt_attention.jsonl, registers.jsonl.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/gpu
for b in attention-bench fused_parity fused_native_layout fused_separate_backward half_precision ops fused_parity_wgpu fused_lanes_wgpu fused_native_layout_wgpu; do
  [ -f ".carry/gpu/$b.xz" ] && xz -dc ".carry/gpu/$b.xz" > "/tmp/gpu/$b" && chmod +x "/tmp/gpu/$b"
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
status=0
if [ "${PARITY:-1}" = 1 ]; then
  for lanes in ${PARITY_LANES:-default 1}; do
    log="$OUT/fused_parity.log"; env=""
    [ "$lanes" = 1 ] && { log="$OUT/fused_parity_lanes1.log"; env="AAM_KERNEL_LANES=1 AAM_KERNEL_TILED=0 AAM_KERNEL_MMA=0"; }
    echo "== fused_parity (cuda, lanes $lanes)"
    env $env timeout "${PARITY_TIMEOUT:-280}" /tmp/gpu/fused_parity ${PARITY_FILTER:-} --nocapture --test-threads "${PARITY_THREADS:-8}" > "$log" 2>&1
    rc=$?; [ $rc -eq 0 ] || status=1
    grep -E "^test .*(ok|FAILED)$|panicked|test result" "$log" | cut -c1-200 | tail -30
    echo "rc=$rc"
  done
  # One carried CUDA test binary: its title, and a pattern of extra lines to show.
  cuda_test() {
    [ -x "/tmp/gpu/$1" ] || return 0
    echo "== $1 ($2)"
    timeout "${PARITY_TIMEOUT:-280}" "/tmp/gpu/$1" --nocapture > "$OUT/$1.log" 2>&1
    rc=$?; [ $rc -eq 0 ] || status=1
    grep -E "^test .*(ok|FAILED)$|panicked|test result${3:+|$3}" "$OUT/$1.log" | cut -c1-200
    echo "rc=$rc"
  }
  cuda_test fused_native_layout "cuda, head dims split over two units"
  cuda_test fused_separate_backward "cuda, dQ and dK/dV kernels at every shape"
  cuda_test half_precision "cuda: tensor-core forward and gradients against the f32 kernel" 'BF16 \(151'
  if [ -x /tmp/gpu/ops ]; then
    echo "== ops ${OPS_FILTER:-packed_attention::} (cuda)"
    timeout "${PARITY_TIMEOUT:-280}" /tmp/gpu/ops "${OPS_FILTER:-packed_attention::}" --nocapture > "$OUT/ops.log" 2>&1
    rc=$?; [ $rc -eq 0 ] || status=1
    grep -E "^test .*(ok|FAILED)$|panicked|test result|BF16 .*t=151" "$OUT/ops.log" | cut -c1-200
    echo "rc=$rc"
  fi
fi
if [ "${WGPU_PARITY:-0}" = 1 ]; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
  if ! ls /usr/share/vulkan/icd.d/nvidia_icd.json /etc/vulkan/icd.d/nvidia_icd.json >/dev/null 2>&1; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  fi
  for t in fused_parity fused_lanes fused_native_layout; do
    echo "== $t (wgpu, Vulkan)"
    timeout "${PARITY_TIMEOUT:-280}" "/tmp/gpu/${t}_wgpu" --nocapture --test-threads "${PARITY_THREADS:-8}" > "$OUT/${t}_wgpu.log" 2>&1
    rc=$?; [ $rc -eq 0 ] || status=1
    grep -E "^test .*(ok|FAILED)$|panicked|test result|adapter|Adapter" "$OUT/${t}_wgpu.log" | cut -c1-200 | tail -30
    echo "rc=$rc"
  done
fi
[ "${BENCH:-1}" = 1 ] || exit $status
echo "== attention-bench (aam-rs)"
/tmp/gpu/attention-bench > "$OUT/rs_attention.jsonl" 2>&1 || status=1
cat "$OUT/rs_attention.jsonl"
if [ "${LANES_COMPARE:-1}" = 1 ]; then
  echo "== attention-bench, AAM_KERNEL_LANES=1"
  AAM_KERNEL_LANES=1 /tmp/gpu/attention-bench > "$OUT/rs_attention_lanes1.jsonl" 2>&1 || status=1
  grep '"fused"' "$OUT/rs_attention_lanes1.jsonl"
fi
if [ "${MERGED_COMPARE:-0}" = 1 ]; then
  echo "== attention-bench, AAM_KERNEL_MERGED_BACKWARD=0"
  AAM_KERNEL_MERGED_BACKWARD=0 /tmp/gpu/attention-bench > "$OUT/rs_attention_separate.jsonl" 2>&1 || status=1
  grep '"fused"' "$OUT/rs_attention_separate.jsonl"
fi
for setting in ${COMPARE_ENVS:-}; do
  echo "== attention-bench, $setting"
  env "$setting" /tmp/gpu/attention-bench > "$OUT/rs_attention_${setting//=/_}.jsonl" 2>&1 || status=1
  grep '"fused"' "$OUT/rs_attention_${setting//=/_}.jsonl"
done
if [ "${TC_COMPARE:-0}" = 1 ]; then
  for dt in ${TC_DTYPES:-bf16}; do
    for tc in ${TC_MODES:-auto forward 0}; do
      echo "== attention-bench, $dt alone, AAM_KERNEL_TC=$tc"
      AAM_BENCH_DTYPES=$dt AAM_KERNEL_TC=$tc /tmp/gpu/attention-bench > "$OUT/rs_attention_tc_${dt}_$tc.jsonl" 2>&1 || status=1
      grep '"fused"' "$OUT/rs_attention_tc_${dt}_$tc.jsonl"
    done
  done
  for planes in ${TC_PLANES:-}; do
    echo "== attention-bench, bf16 alone, AAM_KERNEL_TC_PLANES=$planes"
    AAM_BENCH_DTYPES=bf16 AAM_KERNEL_TC_PLANES=$planes /tmp/gpu/attention-bench > "$OUT/rs_attention_tc_planes$planes.jsonl" 2>&1 || status=1
    grep '"fused"' "$OUT/rs_attention_tc_planes$planes.jsonl"
  done
fi
echo "== PyTorch SDPA (pt_attention.py)"
PYTHONUNBUFFERED=1 python3 benches/pt_attention.py > "$OUT/pt_attention.jsonl" 2>&1 || status=1
grep -v Warning "$OUT/pt_attention.jsonl" | grep '^{'
if [ "${REGISTERS:-0}" = 1 ]; then
  echo "== registers (ptxas -v on CubeCL's cached PTX)"
  python3 benches/ptx_registers.py . --keep "$OUT/ptx" > "$OUT/registers.jsonl" 2>&1 || status=1
  cat "$OUT/registers.jsonl"
fi
exit $status
