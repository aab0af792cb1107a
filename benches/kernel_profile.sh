#!/usr/bin/env bash
# Why the attention kernels take the time they take, on a GPU machine: registers and
# spills of each kernel (ptxas -v on CubeCL's cached PTX, benches/ptx_registers.py) and Nsight
# Compute's view of the ASV-shape launches (the first forward, dQ and dK/dV launches of
# `attention-bench`: its accuracy check at the ASV shape), f32 (PROFILE_DTYPE=bf16: the bf16
# launches, on tensor cores by default).
# Carry .carry/gpu/attention-bench.xz (see benches/attention_device.sh for the build).
# Env: NCU_SECTIONS (default: SpeedOfLight, Occupancy, LaunchStats, WarpStateStats,
# MemoryWorkloadAnalysis, ComputeWorkloadAnalysis, SchedulerStats, InstructionStats).
# Writes to $OUT: registers.jsonl, ncu_{forward,backward}.txt.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/gpu
xz -dc .carry/gpu/attention-bench.xz > /tmp/gpu/attention-bench && chmod +x /tmp/gpu/attention-bench
export AAM_BENCH_DTYPES=${PROFILE_DTYPE:-f32}
sections=${NCU_SECTIONS:-SpeedOfLight Occupancy LaunchStats WarpStateStats MemoryWorkloadAnalysis ComputeWorkloadAnalysis SchedulerStats InstructionStats}
args=(); for s in $sections; do args+=(--section "$s"); done
ncu=/usr/local/cuda/bin/ncu
status=0
# The first run also fills CubeCL's PTX cache (target/ here) for the register counts.
$ncu "${args[@]}" -k regex:attention_forward -c 1 /tmp/gpu/attention-bench > "$OUT/ncu_forward.txt" 2>&1 || status=1
$ncu "${args[@]}" -k regex:attention_backward -c 2 /tmp/gpu/attention-bench > "$OUT/ncu_backward.txt" 2>&1 || status=1
python3 benches/ptx_registers.py . > "$OUT/registers.jsonl" 2>&1 || status=1
grep attention "$OUT/registers.jsonl"
grep -E "attention_|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Memory Throughput|Block Limit|Issue Slots Busy|No Eligible|ERR|==PROF==|==ERROR==" "$OUT"/ncu_*.txt | cut -c1-200 | head -80
exit $status
