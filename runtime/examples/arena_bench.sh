#!/usr/bin/env bash
# The plan's device arena on the H200 (each arena allocated once, buffers at the plan's
# offsets): the GPU loop tests (serial vs overlap bitwise with every kept buffer at its plan
# offset, and bitwise equal to the same run from the memory pool; `rollplex-run` of the tiny H200
# pipeline saving and resuming a checkpoint; the runtime library's own GPU tests, `gpu::`:
# the device decode loop, the model against its CPU twin, training), then the shipped 3B video
# pipeline (examples/h200-3b-video.rpx, PLANS below) run by `iteration_bench` twice, back to
# back: models and buffers from the memory pool, then `--placed` (models built for the plan,
# its arena allocated once, weights, optimizer state and the iteration's kept buffers at the
# plan's offsets: what `rollplex-run` does). Iteration times, peak memory and the arena's
# per-region use side by side.
#
# Entry point: scripts/gpu-bench.sh build arena, then scripts/gpu-bench.sh run arena [tests|bench].
#   1. build (on a machine with the Rust toolchain, no GPU needed) packs the binaries: the plans,
#      the stripped iteration_bench, rollplex-run, the gpu_loop and gpu_resume test binaries, the
#      runtime library's test binary and the tiny H200 plan into $DIR (default .gpu-pack/arena,
#      the packed binaries, ignored by git):
#        bash runtime/examples/arena_bench.sh build
#   2. run (on the H200, repository root, $DIR beside it) unpacks and runs them:
#        bash runtime/examples/arena_bench.sh tests
#        bash runtime/examples/arena_bench.sh bench
# Knobs of build: PROMPTS (the pipeline's `const PROMPTS`, default as shipped) and PRESET (its
# GPU preset, default H200: H100 to run on an H100, with fewer prompts to fit 80 GB);
# BEFORE=REV also builds REV's iteration_bench and plans (from a temporary git worktree), and
# bench then runs REV's binaries and this tree's one after the other, twice, alternating, on
# the same pipeline: the change measured side by side in one run. BUDGET=SIZE (e.g. 83GiB)
# instead compiles the same pipeline a second time with `memory = SIZE`, and bench runs this
# tree's binaries over those plans and the shipped ones, alternating: a planner decision that
# memory buys (kept activations, residency) measured against the plan without the memory for
# it. VARIANT=SED does the same with the sed expression SED applied to the pipeline instead
# (e.g. VARIANT='s/micro_batch = G /micro_batch = 4 * G /': another setting of the same job on
# the same binaries, alternating with the shipped one). Each of these processes also writes its
# plans' task profiles under prof-WHO-ROUND of the results, for `rollplexc merge-profiles`: a
# VARIANT with another micro-batch size gives a refit the sizes the shipped plans never run.
set -euo pipefail
MODE=${1:-}
DIR=${DIR:-.gpu-pack/arena}
PROFILE=${PROFILE:-cost/profiles/h200-3b-runtime.yaml}
PROMPTS=${PROMPTS:-}
PRESET=${PRESET:-H200}
BEFORE=${BEFORE:-}
BUDGET=${BUDGET:-}
VARIANT=${VARIANT:-}
T=${CARGO_TARGET_DIR:-$PWD/target}/release

die() { echo "arena_bench: $*" >&2; exit 1; }
. "$(dirname "$0")/common/gpu_pack.sh"

# the newest test binary of a cargo test target (`cargo test --release ARGS --no-run`)
test_bin() {
  cargo test --release "$@" --no-run --message-format=json 2>/dev/null |
    sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1
}

# pipeline SRC DEST [MEMORY]: the 3B video pipeline with the PROMPTS and PRESET knobs applied
# (and its schedule's device memory budget set to MEMORY when given).
pipeline() {
  sed -e "s/preset = H200/preset = $PRESET/" \
    -e "${PROMPTS:+s/^const PROMPTS = [0-9]*/const PROMPTS = $PROMPTS/}" \
    -e "${3:+s/^\( *\)host_memory = \(.*\)/\1host_memory = \2\n\1memory = $3/}" "$1" > "$2"
  [ -z "${3:-}" ] || grep -q "memory = $3" "$2" || die "no host_memory line in $1 to set memory = $3 beside"
}

# plans ROLLPLEXC PROFILE PIPELINE OUTDIR LIST: the serial and overlap plans of PIPELINE into
# OUTDIR, their paths (as the GPU host sees them) appended to LIST.
plans() {
  local m
  for m in serial overlap; do
    "$1" "$3" --mode $m --profile "$2" -o "$4/$m.plan.bin" 2>&1 | sed "s|^|$m: |"
    echo "$4/$m.plan.bin" >> "$5"
  done
}

# The BEFORE revision's iteration_bench and plans into $DIR/before (build_rev: a target
# directory of their own); the pipeline, and the profile where BEFORE has one, as BEFORE has them.
build_before() {
  local rc rt prof=$PROFILE
  rc=$(build_rev "$BEFORE" -p rollplex-compiler --bin rollplexc) || die "building $BEFORE's rollplexc failed"
  rt=$(build_rev "$BEFORE" -p rollplex-runtime --example iteration_bench) ||
    die "building $BEFORE's iteration_bench failed"
  mkdir -p "$DIR/before"
  : > "$DIR/before/plans.txt"
  if git cat-file -e "$BEFORE:$PROFILE" 2> /dev/null; then
    prof=$DIR/before/profile.yaml
    git show "$BEFORE:$PROFILE" > "$prof"
  fi
  git show "$BEFORE:examples/h200-3b-video.rpx" > "$DIR/before/shipped.rpx"
  pipeline "$DIR/before/shipped.rpx" "$DIR/before/pipeline.rpx"
  plans "$rc/rollplexc" "$prof" "$DIR/before/pipeline.rpx" "$DIR/before" "$DIR/before/plans.txt"
  pack_bins "$DIR/before/bin.tar.xz" "$rt/examples/iteration_bench"
  git rev-parse --short "$BEFORE" > "$DIR/before/rev"
}

build() {
  mkdir -p "$DIR"
  rm -rf "$DIR/before"
  local knobs=0
  for k in "$BEFORE" "$BUDGET" "$VARIANT"; do [ -z "$k" ] || knobs=$((knobs + 1)); done
  [ $knobs -le 1 ] || die "BEFORE, BUDGET and VARIANT are different comparisons: one at a time"
  [ -z "$BEFORE" ] || build_before
  cargo build --release -p rollplex-compiler --bin rollplexc
  cargo build --release -p rollplex-runtime --example iteration_bench --bin rollplex-run
  : > "$DIR/plans.txt"
  git rev-parse --short HEAD > "$DIR/rev"
  pipeline examples/h200-3b-video.rpx "$DIR/pipeline.rpx"
  plans "$T/rollplexc" "$PROFILE" "$DIR/pipeline.rpx" "$DIR" "$DIR/plans.txt"
  if [ -n "$BUDGET$VARIANT" ]; then
    # the "before" side of bench: this tree's binaries over the pipeline at BUDGET or with
    # VARIANT applied
    local b=$DIR/before
    mkdir -p "$b"
    : > "$b/plans.txt"
    pipeline examples/h200-3b-video.rpx "$b/pipeline.rpx" "$BUDGET"
    if [ -n "$VARIANT" ]; then
      sed -i -e "$VARIANT" "$b/pipeline.rpx"
      ! cmp -s "$DIR/pipeline.rpx" "$b/pipeline.rpx" || die "VARIANT '$VARIANT' changes nothing in the pipeline"
    fi
    plans "$T/rollplexc" "$PROFILE" "$b/pipeline.rpx" "$b" "$b/plans.txt"
    echo "${BUDGET:+memory = $BUDGET}${VARIANT:+variant: $VARIANT}" > "$b/rev"
  fi
  "$T/rollplexc" examples/tiny-h200.rpx -o "$DIR/tiny-h200.plan.bin"
  local loop resume lib
  loop=$(test_bin -p rollplex-tests --test gpu_loop) || die "building the gpu_loop test failed"
  resume=$(test_bin -p rollplex-tests --test gpu_resume) || die "building the gpu_resume test failed"
  lib=$(test_bin -p rollplex-runtime --lib) || die "building the runtime library's tests failed"
  [ -x "$loop" ] && [ -x "$resume" ] && [ -x "$lib" ] || die "test binaries not found"
  cp "$loop" "$T/gpu_loop-test"
  cp "$resume" "$T/gpu_resume-test"
  cp "$lib" "$T/runtime_lib-test"
  pack_bins "$DIR/bin.tar.xz" "$T/examples/iteration_bench" "$T/rollplex-run" "$T/gpu_loop-test" \
    "$T/gpu_resume-test" "$T/runtime_lib-test"
  du -ch "$DIR"/* | tail -1
  echo "on the GPU host, with $DIR copied: scripts/gpu-bench.sh run arena [tests|bench]"
}

tests() {
  local bin=/tmp/arena-bin
  unpack_bins "$DIR/bin.tar.xz" "$bin"
  export ROLLPLEX_REQUIRE_GPU=1  # a device that does not open fails the tests, not skips them
  mkdir -p "$RESULTS_DIR/arena"
  "$bin/gpu_loop-test" --nocapture --test-threads 1 2>&1 | tee "$RESULTS_DIR/arena/gpu_loop.log" |
    grep -E "^test |test result|Usage|panicked|spills" || true
  "$bin/gpu_resume-test" --nocapture --test-threads 1 2>&1 | tee "$RESULTS_DIR/arena/gpu_resume.log" |
    grep -E "^test |test result|panicked" || true
  "$bin/runtime_lib-test" gpu:: --nocapture --test-threads 1 2>&1 |
    tee "$RESULTS_DIR/arena/runtime_gpu.log" | grep -E "^test .*(FAILED|ok)$|test result|panicked" |
    grep -v " ok$" || true
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
  if [ -f "$DIR/before/plans.txt" ]; then
    before_after "$bin" "$out"
    pack_results arena
    return
  fi
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

# BEFORE's iteration_bench and this tree's over their own plans of the same pipeline, placed,
# alternating (before, after, before, after), each one process of 3 iterations. With BUDGET or
# VARIANT the "before" side is this tree's binaries over the plans of that setting.
before_after() {
  local bin=$1 out=$2 old=/tmp/arena-before rev
  if [ -f "$DIR/before/bin.tar.xz" ]; then
    unpack_bins "$DIR/before/bin.tar.xz" "$old"
  else
    old=$bin
  fi
  rev=$(cat "$DIR/before/rev")
  for round in 1 2; do
    for who in before after; do
      local b=$bin list=$DIR/plans.txt
      [ $who = after ] || { b=$old; list=$DIR/before/plans.txt; }
      # shellcheck disable=SC2046
      timeout "${LIMIT:-270}" "$b/iteration_bench" $(cat "$list") --iterations 3 --rounds 1 --placed \
        --profile-dir "$out/prof-$who-$round" \
        > "$out/$who-$round.log" 2>&1 || echo "iteration_bench ($who, round $round) exit $?"
      echo "== round $round: $who ($([ $who = before ] && echo "$rev" || cat "$DIR/rev"))"
      grep -v "^round" "$out/$who-$round.log" | tail -16
    done
  done
}

case "$MODE" in
  build) build ;;
  tests) tests ;;
  bench) bench ;;
  *) die "usage: $0 build | tests | bench (see the header)" ;;
esac
