#!/usr/bin/env bash
# The vision tower / merger backward's GPU checks on a GPU host, in one run. Entry point:
# scripts/gpu-bench.sh build|run vision-bwd.
#
# build (on a machine with the Rust toolchain) packs the binaries:
#   bash runtime/examples/vision_bwd_check.sh build
# which runs
#   cargo test --release -p rollplex-runtime --lib --no-run                    -> rt-tests
#   cargo test --release -p rollplex-kernels --test cuda_backward --no-run     -> cuda_backward
# and copies the two binaries, stripped, into $DEVBIN (default .gpu-pack/vision-bwd, the packed
# binaries, ignored by git). run (on the GPU host, repository root, $DEVBIN beside it):
#   bash runtime/examples/vision_bwd_check.sh          # steps: kernel vision forward sanitize
# Steps: kernel = gelu_bwd_bf16 vs its CPU twins (cuda_backward); vision = gpu::vision_train (one
# process per test); forward = the tests that cover encode_media and the text trainer, whose
# code vision.rs now shares (gpu::tests, gpu::train); sanitize = compute-sanitizer memcheck on the
# vision backward test. Logs under $OUT (default /tmp/rollplex-out).
set -o pipefail
B=${DEVBIN:-.gpu-pack/vision-bwd}
OUT=${OUT:-/tmp/rollplex-out}
export ROLLPLEX_KERNEL_CACHE=${ROLLPLEX_KERNEL_CACHE:-/tmp/rollplex-kernels}
steps=${*:-kernel vision forward sanitize}

# builds a test binary and prints its path (cargo's "Executable ... (path)" line)
built() { cargo test --release "$@" --no-run 2>&1 | tee /dev/stderr \
  | sed -n 's/^ *Executable .*(\(.*\))$/\1/p' | tail -1; }

if [ "$steps" = build ]; then
  rt=$(built -p rollplex-runtime --lib) && [ -n "$rt" ] || exit 1
  kb=$(built -p rollplex-kernels --test cuda_backward) && [ -n "$kb" ] || exit 1
  mkdir -p "$B"
  cp "$rt" "$B/rt-tests" && strip "$B/rt-tests"
  cp "$kb" "$B/cuda_backward" && strip "$B/cuda_backward"
  ls -l "$B"
  exit 0
fi

mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; } 2>&1 | tee "$OUT/device.txt"
run_tests() {  # binary, grep filter of test names
  for t in $("$B/$1" --list 2>/dev/null | sed -n 's/: test$//p' | grep -E "$2"); do
    timeout 300 "$B/$1" --exact "$t" --nocapture --test-threads=1 2>&1 \
      | grep -v "^running\|^$\|^test result\|^note:" >> "$OUT/tests.log"
    echo "TEST $1::$t exit $?" | tee -a "$OUT/tests.log"
  done
}
for st in $steps; do
  case $st in
    kernel) run_tests cuda_backward 'gelu_bwd' ;;
    vision) run_tests rt-tests '^gpu::vision_train::' ;;
    forward) run_tests rt-tests '^gpu::tests::|^gpu::train::' ;;
    sanitize)
      t=gpu::vision_train::tests::cuda_vision_backward_matches_the_cpu_backend
      timeout 500 compute-sanitizer --tool memcheck --print-limit 20 "$B/rt-tests" --exact $t \
        --nocapture --test-threads=1 > "$OUT/sanitize_vision.log" 2>&1
      echo "== sanitize $t exit $?"; grep -E "ERROR SUMMARY|worst" "$OUT/sanitize_vision.log" | tail -5 ;;
    *) echo "unknown step $st (kernel, vision, forward, sanitize, or build alone)"; exit 2 ;;
  esac
  echo "== $st exit $?"
done
grep -E "^TEST .* exit [^0]" "$OUT/tests.log" && echo "SOME TESTS FAILED" || echo "all tests passed"
