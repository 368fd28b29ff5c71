#!/usr/bin/env bash
# The CUDA kernels on a GPU host, in one run: the kernel tests (each kernel vs its CPU twin, one
# process per test so that a faulting kernel cannot poison the others; ROLLPLEX_REQUIRE_GPU=1,
# so a device that does not open fails them), the decode kernels under
# compute-sanitizer, the GEMM and decode workbenches (built with `--features bench`), and PyTorch's CUDA-graph decode of the same
# dims (side by side). Entry point: scripts/gpu-bench.sh build|run kernels.
#
# build (on a machine with the Rust toolchain) packs the binaries: the release test binary of
# every kernel test file (kernels/tests/cuda_*.rs, TEST_BINS below) and the examples bench_gemm
# and bench_decode, stripped, into $DEVBIN (default .gpu-pack, the packed binaries, ignored by
# git):
#   bash kernels/examples/gpu_check.sh build
# run (on the GPU host, repository root, $DEVBIN beside it) runs them; logs under $OUT:
#   bash kernels/examples/gpu_check.sh [tests|tests-decode|tests-attention|sanitize|gemm|decode|torch]...
#   (default: tests sanitize gemm decode torch; tests-decode runs only the tests that touch the
#   decode path: cuda_decode, cuda_skinny and the linear tests of cuda_kernels; tests-attention
#   the attention kernels': cuda_prefill_attn, cuda_attn_bwd_tc and the decode attention tests)
# With BEFORE=REV at build, REV's bench_decode is built too (from a temporary git worktree, in
# target/before) into $DEVBIN/before/, and the decode step runs it before this tree's with the
# same DECODE_FLAGS: a kernel change and its predecessor side by side in one run.
set -o pipefail
B=${DEVBIN:-.gpu-pack}
OUT=${OUT:-/tmp/rollplex-out}
export ROLLPLEX_KERNEL_CACHE=${ROLLPLEX_KERNEL_CACHE:-/tmp/rollplex-kernels}
export ROLLPLEX_REQUIRE_GPU=1
steps=${*:-tests sanitize gemm decode torch}
# every kernel test file's binary (the repository's copy on the GPU host lists the same files)
TEST_BINS=$(cd kernels/tests && ls cuda_*.rs | sed 's/\.rs$//')

if [ "$steps" = build ]; then
  set -e
  mkdir -p "$B"
  for t in $TEST_BINS; do
    exe=$(cargo test --release -p rollplex-kernels --test $t --no-run 2>&1 \
      | sed -n "s/.*Executable tests\/$t.rs (\(.*\))/\1/p" | tail -1)
    [ -n "$exe" ] || { echo "no test binary for $t" >&2; exit 1; }
    cp "$exe" "$B/$t"
  done
  cargo build --release -p rollplex-kernels --features bench --example bench_gemm --example bench_decode
  cp "${CARGO_TARGET_DIR:-target}"/release/examples/bench_{gemm,decode} "$B/"
  for f in $TEST_BINS bench_gemm bench_decode; do strip "$B/$f"; done
  rm -rf "$B/before"
  if [ -n "${BEFORE:-}" ]; then
    . runtime/examples/common/gpu_pack.sh
    rt=$(build_rev "$BEFORE" -p rollplex-kernels --features bench --example bench_decode)
    mkdir -p "$B/before"
    cp "$rt/examples/bench_decode" "$B/before/" && strip "$B/before/bench_decode"
    git rev-parse --short "$BEFORE" > "$B/before/rev"
  fi
  ls -la "$B"
  exit 0
fi

mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv; } 2>&1 | tee "$OUT/device.txt"
run_tests() {  # binary, grep filter of test names
  [ -x "$B/$1" ] || { echo "TEST $1 missing from $B: build again" | tee -a "$OUT/tests.log"; return; }
  for t in $("$B/$1" --list 2>/dev/null | sed -n 's/: test$//p' | grep -E "$2"); do
    timeout 120 "$B/$1" --exact "$t" --nocapture 2>&1 | grep -v "^running\|^$\|^test result\|^note:\|^stack backtrace" >> "$OUT/tests.log"
    echo "TEST $1::$t exit $?" | tee -a "$OUT/tests.log"
  done
}
for st in $steps; do
  case $st in
    tests) for t in $TEST_BINS; do run_tests $t . ; done ;;
    tests-decode)
      run_tests cuda_decode .
      run_tests cuda_skinny .
      run_tests cuda_kernels 'linear_fwd' ;;
    tests-attention)
      run_tests cuda_prefill_attn .
      run_tests cuda_attn_bwd_tc .
      run_tests cuda_decode 'attention'
      run_tests cuda_skinny 'attention' ;;
    sanitize)
      for t in attention_decode_tensor_cores_matches_cpu_with_shared_prefix; do
        timeout 150 compute-sanitizer --tool memcheck --print-limit 20 "$B/cuda_decode" --exact $t --nocapture > "$OUT/sanitize_$t.log" 2>&1
        echo "== sanitize $t exit $?"; grep -E "ERROR SUMMARY|rel err" "$OUT/sanitize_$t.log" | tail -3
      done
      for t in attention_decode_grouped_matches_cpu attention_decode_grouped_over_a_group_table_matches_cpu skinny_linear_matches_cpu skinny_gate_up_swiglu_matches_cpu_and_the_unfused_pair; do
        timeout 150 compute-sanitizer --tool memcheck --print-limit 20 "$B/cuda_skinny" --exact $t --nocapture > "$OUT/sanitize_$t.log" 2>&1
        echo "== sanitize $t exit $?"; grep -E "ERROR SUMMARY" "$OUT/sanitize_$t.log" | tail -2
      done ;;
    gemm) timeout 150 "$B/bench_gemm" 2>&1 | tee "$OUT/gemm.log" ;;
    decode)
      if [ -x "$B/before/bench_decode" ]; then
        echo "== bench_decode before ($(cat "$B/before/rev"))" | tee -a "$OUT/decode.log"
        timeout 300 "$B/before/bench_decode" ${DECODE_FLAGS:-} 2>&1 | tee -a "$OUT/decode.log"
        echo "== bench_decode now" | tee -a "$OUT/decode.log"
      fi
      timeout 300 "$B/bench_decode" ${DECODE_FLAGS:-} 2>&1 | tee -a "$OUT/decode.log" ;;
    torch) timeout 200 python3 kernels/examples/torch_decode.py 40 2>&1 | tee "$OUT/torch.log" ;;
  esac
  echo "== $st exit $?"
done
