#!/usr/bin/env bash
# The tensor-core prefix gradients (attention_bwd_tc_dprefix_f32) on a GPU host, in one run: the
# attention backward tests (each test its own process, so that a faulting kernel cannot poison
# the others), the prefix tests under compute-sanitizer (memcheck, racecheck), and the workbench
# (bench_attn_bwd prefix over micro-batches of DPREFIX_GROUPS GRPO groups, default 1,2,4, and
# full: the whole attention backward timed the same way). Logs under $OUT. Entry point:
# scripts/gpu-bench.sh build|run dprefix.
#
# build (on a machine with the Rust toolchain) packs the binaries: release builds of the
# cuda_attn_bwd_tc and cuda_backward tests and of bench_attn_bwd, stripped, into $DEVBIN
# (default .gpu-pack/dprefix, the packed binaries, ignored by git):
#   bash kernels/examples/dprefix_check.sh build
# run (on the GPU host, repository root, $DEVBIN beside it) runs them:
#   bash kernels/examples/dprefix_check.sh [tests|sanitize|racecheck|bench|bench-full]...
#   (default: tests sanitize bench)
set -o pipefail
B=${DEVBIN:-.gpu-pack/dprefix}
OUT=${OUT:-/tmp/rollplex-out}
export ROLLPLEX_KERNEL_CACHE=${ROLLPLEX_KERNEL_CACHE:-/tmp/rollplex-kernels}
export ROLLPLEX_REQUIRE_GPU=1
steps=${*:-tests sanitize bench}

if [ "$steps" = build ]; then
  set -e
  mkdir -p "$B"
  for t in cuda_attn_bwd_tc cuda_backward; do
    exe=$(cargo test --release -p rollplex-kernels --test $t --no-run 2>&1 \
      | sed -n "s/.*Executable tests\/$t.rs (\(.*\))/\1/p" | tail -1)
    [ -n "$exe" ] || { echo "no test binary for $t" >&2; exit 1; }
    cp "$exe" "$B/$t"
  done
  cargo build --release -p rollplex-kernels --features bench --example bench_attn_bwd
  cp "${CARGO_TARGET_DIR:-target}/release/examples/bench_attn_bwd" "$B/"
  strip "$B"/*
  ls -la "$B"
  exit 0
fi

mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv; } 2>&1 | tee "$OUT/device.txt"
run_tests() {  # log, binary, grep filter of test names
  for t in $("$B/$2" --list 2>/dev/null | sed -n 's/: test$//p' | grep -E "$3"); do
    timeout 300 "$B/$2" --exact "$t" --nocapture 2>&1 | grep -v "^running\|^$\|^test result\|^note:" >> "$OUT/$1"
    echo "TEST $2::$t exit $?" | tee -a "$OUT/$1"
  done
}
sanitize() {  # tool, test name
  timeout 580 compute-sanitizer --tool "$1" --print-limit 20 "$B/cuda_attn_bwd_tc" --exact "$2" --nocapture > "$OUT/$1_$2.log" 2>&1
  echo "== $1 $2 exit $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|panicked|rel err .* > " "$OUT/$1_$2.log" | tail -4
}
for st in $steps; do
  case $st in
    tests)
      run_tests tests.log cuda_attn_bwd_tc .
      run_tests tests.log cuda_backward attention_bwd ;;
    sanitize)
      sanitize memcheck attention_bwd_dprefix_tc_splits_match_cpu_and_add
      sanitize memcheck attention_bwd_tc_shared_prefix_cases_match_cpu_and_simt ;;
    racecheck)
      sanitize racecheck attention_bwd_dprefix_tc_splits_match_cpu_and_add ;;
    bench) timeout 300 "$B/bench_attn_bwd" prefix "${DPREFIX_GROUPS:-1,2,4}" 2>&1 | tee "$OUT/bench_prefix.log" ;;
    bench-full) timeout 300 "$B/bench_attn_bwd" full 2>&1 | tee "$OUT/bench_full.log" ;;
    *) echo "unknown step $st (tests sanitize racecheck bench bench-full, or build)" ;;
  esac
  echo "== $st exit $?"
done
grep -h "^TEST .* exit [^0]" "$OUT"/tests*.log 2>/dev/null && echo "== some tests FAILED" || echo "== every test run exited 0"
