#!/usr/bin/env bash
# The plan's device arena on the H200 (each arena allocated once, buffers at the plan's
# offsets): the GPU loop tests (serial vs overlap bitwise with every kept buffer at its plan
# offset, and bitwise equal to the same run from the memory pool; `rollplex-run` of the tiny H200
# pipeline saving and resuming a checkpoint), then the shipped 3B video
# pipeline (examples/h200-3b-video.rpx, PLANS below) run by `iteration_bench` twice, back to
# back: models and buffers from the memory pool, then `--placed` (models built for the plan,
# its arena allocated once, weights, optimizer state and the iteration's kept buffers at the
# plan's offsets: what `rollplex-run` does). Iteration times, peak memory and the arena's
# per-region use side by side.
#
# Entry point: scripts/gpu-bench.sh build arena, then scripts/gpu-bench.sh run arena [tests|bench].
#   1. build (on a machine with the Rust toolchain, no GPU needed) packs the binaries: the plans,
#      the stripped iteration_bench, rollplex-run, the gpu_loop and gpu_resume test binaries
#      and the tiny H200 plan into $DIR (default .gpu-pack/arena, the packed binaries, ignored by git):
#        bash runtime/examples/arena_bench.sh build
#   2. run (on the H200, repository root, $DIR beside it) unpacks and runs them:
#        bash runtime/examples/arena_bench.sh tests
#        bash runtime/examples/arena_bench.sh bench
set -euo pipefail
MODE=${1:-}
DIR=${DIR:-.gpu-pack/arena}
PROFILE=${PROFILE:-cost/profiles/h200-3b-runtime.yaml}
T=${CARGO_TARGET_DIR:-$PWD/target}/release

die() { echo "arena_bench: $*" >&2; exit 1; }
. "$(dirname "$0")/common/gpu_pack.sh"

# the newest test binary of a test target
test_bin() {
  cargo test --release -p rollplex-tests --test "$1" --no-run --message-format=json 2>/dev/null |
    sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1
}

build() {
  cargo build --release -p rollplex-compiler --bin rollplexc
  cargo build --release -p rollplex-runtime --example iteration_bench --bin rollplex-run
  mkdir -p "$DIR"
  : > "$DIR/plans.txt"
  for m in serial overlap; do
    "$T/rollplexc" examples/h200-3b-video.rpx --mode $m --profile "$PROFILE" -o "$DIR/$m.plan.bin" 2>&1 |
      sed "s|^|$m: |"
    echo "$DIR/$m.plan.bin" >> "$DIR/plans.txt"
  done
  "$T/rollplexc" examples/tiny-h200.rpx -o "$DIR/tiny-h200.plan.bin"
  local loop resume
  loop=$(test_bin gpu_loop)
  resume=$(test_bin gpu_resume)
  [ -x "$loop" ] && [ -x "$resume" ] || die "test binaries not found"
  cp "$loop" "$T/gpu_loop-test"
  cp "$resume" "$T/gpu_resume-test"
  pack_bins "$DIR/bin.tar.xz" "$T/examples/iteration_bench" "$T/rollplex-run" "$T/gpu_loop-test" \
    "$T/gpu_resume-test"
  du -ch "$DIR"/* | tail -1
  echo "on the GPU host, with $DIR copied: scripts/gpu-bench.sh run arena [tests|bench]"
}

tests() {
  local bin=/tmp/arena-bin
  unpack_bins "$DIR/bin.tar.xz" "$bin"
  mkdir -p "$RESULTS_DIR/arena"
  "$bin/gpu_loop-test" --nocapture --test-threads 1 2>&1 | tee "$RESULTS_DIR/arena/gpu_loop.log" |
    grep -E "^test |test result|Usage|panicked|spills" || true
  "$bin/gpu_resume-test" --nocapture --test-threads 1 2>&1 | tee "$RESULTS_DIR/arena/gpu_resume.log" |
    grep -E "^test |test result|panicked" || true
  # rollplex-run itself (models built for the plan), saving a checkpoint and resuming from it
  local o=$RESULTS_DIR/arena/run
  rm -rf "$o" "$o-resumed"
  "$bin/rollplex-run" "$DIR/tiny-h200.plan.bin" --iterations 4 --save-every 2 --out "$o" 2>&1 |
    tee "$RESULTS_DIR/arena/run.log" | tail -22
  "$bin/rollplex-run" "$DIR/tiny-h200.plan.bin" --iterations 4 --resume "$o/checkpoints/iter-00000002" \
    --out "$o-resumed" 2>&1 | tee "$RESULTS_DIR/arena/resume.log" | tail -10
  rm -rf "$o/checkpoints" "$o-resumed/checkpoints"
  pack_results arena
}

bench() {
  local bin=/tmp/arena-bin out=$RESULTS_DIR/arena
  unpack_bins "$DIR/bin.tar.xz" "$bin"
  mkdir -p "$out"
  for how in pool placed; do
    local flag=""
    [ $how = pool ] || flag=--placed
    # shellcheck disable=SC2046
    timeout "${LIMIT:-270}" "$bin/iteration_bench" $(cat "$DIR/plans.txt") --iterations 3 --rounds 1 $flag \
      > "$out/bench-$how.log" 2>&1 || echo "iteration_bench ($how) exit $?"
    echo "== $how"
    grep -v "^round" "$out/bench-$how.log" | tail -16
  done
  pack_results arena
}

case "$MODE" in
  build) build ;;
  tests) tests ;;
  bench) bench ;;
  *) die "usage: $0 build | tests | bench (see the header)" ;;
esac
