#!/usr/bin/env bash
# One device call: GPU tests (each kernel vs its CPU twin, one process per test so that a
# faulting kernel cannot poison the others), the tensor-core decode under compute-sanitizer,
# then the GEMM and decode workbenches. Expects prebuilt binaries in .devbin/ (docs/cuda.md);
# writes logs under $OUT.
# Usage: bash kernels/examples/gpu_check.sh [tests|sanitize|gemm|decode]...  (default: all)
set -o pipefail
B=${DEVBIN:-.devbin}
OUT=${OUT:-/tmp/rollplex-out}
mkdir -p "$OUT"
export ROLLPLEX_KERNEL_CACHE=${ROLLPLEX_KERNEL_CACHE:-/tmp/rollplex-kernels}
steps=${*:-tests sanitize gemm decode}
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv; } 2>&1 | tee "$OUT/device.txt"
for st in $steps; do
  case $st in
    tests)
      for t in $("$B/cuda_kernels" --list 2>/dev/null | sed -n 's/: test$//p'); do
        timeout 120 "$B/cuda_kernels" --exact "$t" --nocapture 2>&1 | grep -v "^running\|^$\|^test result\|^note:\|^stack backtrace" >> "$OUT/tests.log"
        echo "TEST $t exit $?" | tee -a "$OUT/tests.log"
      done ;;
    sanitize)
      timeout 150 compute-sanitizer --tool memcheck --print-limit 20 "$B/cuda_kernels" --exact attention_decode_tensor_cores_matches_cpu_with_shared_prefix --nocapture > "$OUT/sanitize.log" 2>&1
      echo "== sanitize exit $?"; head -c 6000 "$OUT/sanitize.log" ;;
    gemm) timeout 150 "$B/bench_gemm" 2>&1 | tee "$OUT/gemm.log" ;;
    decode)
      for v in "--unfused" "--simt" ""; do
        timeout 150 "$B/bench_decode" $v 2>&1 | tee -a "$OUT/decode.log"
        echo "== decode $v exit $?"
      done ;;
  esac
  echo "== $st exit $?"
done
