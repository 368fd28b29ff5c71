#!/usr/bin/env bash
# One device call: GPU tests (each kernel vs its CPU twin), then the GEMM and decode workbenches.
# Expects prebuilt binaries in .devbin/ (see docs/cuda.md); writes logs under $OUT.
# Usage: bash kernels/examples/gpu_check.sh [tests|gemm|decode]...   (default: all three)
set -o pipefail
B=${DEVBIN:-.devbin}
OUT=${OUT:-/tmp/rollplex-out}
mkdir -p "$OUT"
export ROLLPLEX_KERNEL_CACHE=${ROLLPLEX_KERNEL_CACHE:-/tmp/rollplex-kernels}
steps=${*:-tests gemm decode}
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv; } 2>&1 | tee "$OUT/device.txt"
for st in $steps; do
  case $st in
    tests) timeout 240 "$B/cuda_kernels" --test-threads=1 --nocapture 2>&1 | tee "$OUT/tests.log" ;;
    gemm) timeout 150 "$B/bench_gemm" 2>&1 | tee "$OUT/gemm.log" ;;
    decode) timeout 240 "$B/bench_decode" 2>&1 | tee "$OUT/decode.log" ;;
  esac
  echo "== $st exit $?"
done
