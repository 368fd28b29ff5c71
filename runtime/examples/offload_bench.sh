#!/usr/bin/env bash
# Phase-aware memory on one H200 with the 7B video job (examples/h200-7b-video.rpx; docs/perf.md,
# "7B video iteration"). Its plans, compiled with PROFILE:
#   serial, overlap   the shipped pipeline: the reference weights on the host, reloaded before
#                     scoring (beside decode in the overlap plan)
#   stream            `optimizer_state = stream`: masters and moments in pinned host memory,
#                     streamed through three device chunks by each optimizer step (serial)
#   host              `optimizer_state = host`: the same state reloaded before the optimizer
#                     step and written back after it (overlap; the copies the profile measures
#                     device -> host by)
#   big               everything in HBM (`hbm = 400GiB`): the unlimited-memory prediction, and
#                     `rollplex-run` must refuse it before any work (above the H200's memory)
#   host-3b           the 3B video job (examples/h200-3b-video.rpx) with `optimizer_state = host`:
#                     37 GB of state reloaded and written back each iteration, for a host that
#                     cannot pin the 7B `host` plan's 101 GiB beside the 33 GB host model (the
#                     run refuses that plan before building anything)
# Each plan runs placed (`iteration_bench --placed`: its arena, buffers at its offsets, the
# host copies on the copy stream) with --profile-dir, so the host link's rates per direction
# land in the profiles (merge them: `rollplexc merge-profiles`).
#
# Entry point: scripts/gpu-bench.sh build offload, then scripts/gpu-bench.sh run offload [PLAN...].
#   1. build (on a machine with the Rust toolchain, no GPU needed) compiles the plans (their
#      predictions and peaks in $DIR/plans.txt) and packs the stripped iteration_bench and
#      rollplex-run into $DIR (default .gpu-pack/offload, the packed binaries, ignored by git):
#        bash runtime/examples/offload_bench.sh build
#   2. device (on the H200, repository root, $DIR beside it): the named plans (default: serial
#      overlap) in one iteration_bench process (models built once from one host model; a plan
#      of another arena layout rebuilds the device side), then `big` when named, which must be
#      refused. A 7B model build takes about 100 s and a warm iteration 12-15 s:
#        bash runtime/examples/offload_bench.sh device stream host
#      Logs and profiles under $RESULTS_DIR/offload, packed as $OUT/offload.tgz when OUT is set.
#      `host-3b` runs in a process of its own (another job).
# Knobs: ITERATIONS (3), LIMIT (seconds for iteration_bench, 560).
set -euo pipefail
MODE=${1:-}
DIR=${DIR:-.gpu-pack/offload}
PROFILE=${PROFILE:-cost/profiles/h200-runtime.yaml}
ITERATIONS=${ITERATIONS:-3}
T=${CARGO_TARGET_DIR:-$PWD/target}/release
SRC=examples/h200-7b-video.rpx
SRC3=examples/h200-3b-video.rpx

die() { echo "offload_bench: $*" >&2; exit 1; }
. "$(dirname "$0")/common/gpu_pack.sh"

# variant NAME: the pipeline text of plan NAME
variant() {
  case "$1" in
    serial | overlap) cat "$SRC" ;;
    stream | host) sed "s/^        recompute = full$/        recompute = full\n        optimizer_state = $1/" "$SRC" ;;
    big) sed 's/^    gpu { preset = H200 }$/    gpu { preset = H200, hbm = 400GiB }/' "$SRC" ;;
    host-3b) sed 's/^        recompute = auto .*$/        recompute = auto\n        optimizer_state = host/' "$SRC3" ;;
    *) die "unknown plan '$1' (serial overlap stream host big host-3b)" ;;
  esac
}

mode_of() {
  case "$1" in
    serial | stream) echo serial ;;
    *) echo overlap ;;
  esac
}

build() {
  cargo build --release -p rollplex-compiler --bin rollplexc
  cargo build --release -p rollplex-runtime --example iteration_bench --bin rollplex-run
  grep -q '^        recompute = full$' "$SRC" || die "$SRC: no 'recompute = full' line to add optimizer_state after"
  grep -q '^    gpu { preset = H200 }$' "$SRC" || die "$SRC: no 'gpu { preset = H200 }' line to widen"
  mkdir -p "$DIR"
  : > "$DIR/plans.txt"
  local p f
  grep -q '^        recompute = auto ' "$SRC3" || die "$SRC3: no 'recompute = auto' line to add optimizer_state after"
  for p in serial overlap stream host big host-3b; do
    f="$DIR/$p.rpx"
    variant "$p" > "$f"
    if [ "$p" != serial ] && [ "$p" != overlap ] && { cmp -s "$f" "$SRC" || cmp -s "$f" "$SRC3"; }; then
      die "the $p variant did not change its pipeline"
    fi
    "$T/rollplexc" "$f" --mode "$(mode_of "$p")" --profile "$PROFILE" -o "$DIR/$p.plan.bin" 2>&1 |
      tail -1 | sed "s|^|$p: |" | tee -a "$DIR/plans.txt"
  done
  pack_bins "$DIR/bin.tar.xz" "$T/examples/iteration_bench" "$T/rollplex-run"
  du -ch "$DIR"/* | tail -1
  echo "on the GPU host, with $DIR copied: scripts/gpu-bench.sh run offload [serial overlap stream host big host-3b]"
}

device() {
  local bin=/tmp/offload-bin out=$RESULTS_DIR/offload plans=() small=() big=0 p
  unpack_bins "$DIR/bin.tar.xz" "$bin"
  mkdir -p "$out/prof"
  [ $# -gt 0 ] || set -- serial overlap
  for p in "$@"; do
    [ "$p" = big ] && { big=1; continue; }
    [ -f "$DIR/$p.plan.bin" ] || die "no plan $DIR/$p.plan.bin (build first)"
    if [ "$p" = host-3b ]; then small+=("$DIR/$p.plan.bin"); else plans+=("$DIR/$p.plan.bin"); fi
  done
  cat "$DIR/plans.txt"
  # one iteration_bench process per job; LIMIT bounds each
  bench() {
    local log=$1
    shift
    timeout "${LIMIT:-560}" "$bin/iteration_bench" "$@" --placed --iterations "$ITERATIONS" \
      --rounds 1 --profile-dir "$out/prof" > "$log" 2>&1 || echo "iteration_bench exit $?"
    tail -30 "$log"
  }
  [ ${#small[@]} -eq 0 ] || bench "$out/bench-3b.log" "${small[@]}"
  [ ${#plans[@]} -eq 0 ] || bench "$out/bench.log" "${plans[@]}"

  if [ $big = 1 ]; then
    local t0 rc=0
    t0=$(date +%s%N)
    "$bin/rollplex-run" "$DIR/big.plan.bin" --iterations 2 --out "$out/big" > "$out/big.log" 2>&1 || rc=$?
    echo "big: rollplex-run exit $rc after $(( ($(date +%s%N) - t0) / 1000000 )) ms: $(tail -1 "$out/big.log")"
    [ $rc != 0 ] || echo "big: expected a refusal"
  fi
  pack_results offload
}

case "$MODE" in
  build) build ;;
  device) shift; device "$@" ;;
  *) die "usage: $0 build | device [serial overlap stream host big host-3b] (see the header)" ;;
esac
