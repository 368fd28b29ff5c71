#!/usr/bin/env bash
# The CUDA training step at the RL loop's micro-batch shape (docs/perf.md, "Training step"):
# gpu_train_bench with 8 layers of the 3B widths and one GRPO group of 8 (prompt 1,226 tokens,
# responses 271: the 3B video job's micro-batch), then where its time goes, kernel by kernel.
#
# Entry point: scripts/gpu-bench.sh build train, then scripts/gpu-bench.sh run train
# [bench|groups|kernels].
#   1. build (on a machine with the Rust toolchain, no GPU needed) packs the stripped
#      gpu_train_bench into $DIR (default .gpu-pack/train, the packed binaries, ignored by git):
#        bash runtime/examples/train_bench.sh build
#   2. on the GPU host (repository root, $DIR beside it):
#        bash runtime/examples/train_bench.sh bench     # the step's times and parts, PyTorch's beside it
#        bash runtime/examples/train_bench.sh groups    # micro-batches of MB_GROUPS GRPO groups (default
#                                                       # 1 2 4), --step-only, each with its kernel
#                                                       # times (ROLLPLEX_KERNEL_TIMES=1), two rounds
#        bash runtime/examples/train_bench.sh kernels   # Nsight Compute: one micro-batch's kernels,
#                                                       # microseconds each (--step-only: 3 equal calls)
#      Logs under $RESULTS_DIR/train (packed as $OUT/train.tgz when OUT is set).
# Knobs: LAYERS (8), ITERS (5), PEER (1; 0: `bench` skips PyTorch's step), MB_GROUPS (1 2 4).
# BEFORE=REV (build) also packs REV's gpu_train_bench (built from a temporary git worktree) into
# $DIR/before; `bench` and `groups` then run REV's step and this tree's one after the other,
# twice, alternating, and `kernels` profiles both: a change and its predecessor side by side in
# one run.
set -euo pipefail
MODE=${1:-}
DIR=${DIR:-.gpu-pack/train}
LAYERS=${LAYERS:-8}
ITERS=${ITERS:-5}
PEER=${PEER:-1}
BEFORE=${BEFORE:-}
T=${CARGO_TARGET_DIR:-$PWD/target}/release

die() { echo "train_bench: $*" >&2; exit 1; }
. "$(dirname "$0")/common/gpu_pack.sh"

MB_GROUPS=${MB_GROUPS:-1 2 4}
LOOP_SHAPE=(--seq-len 1496 --prompt-len 1226 --group 8)
SHAPE=(--layers "$LAYERS" --seqs 8 "${LOOP_SHAPE[@]}")

build() {
  cargo build --release -p rollplex-runtime --example gpu_train_bench
  mkdir -p "$DIR"
  pack_bins "$DIR/bin.tar.xz" "$T/examples/gpu_train_bench"
  git rev-parse --short HEAD > "$DIR/rev"
  rm -rf "$DIR/before"
  if [ -n "$BEFORE" ]; then
    local rt
    rt=$(build_rev "$BEFORE" -p rollplex-runtime --example gpu_train_bench) ||
      die "building $BEFORE's gpu_train_bench failed"
    mkdir -p "$DIR/before"
    pack_bins "$DIR/before/bin.tar.xz" "$rt/examples/gpu_train_bench"
    git rev-parse --short "$BEFORE" > "$DIR/before/rev"
  fi
  du -h "$DIR"/bin.tar.xz "$DIR"/before/bin.tar.xz 2> /dev/null || true
  echo "on the GPU host, with $DIR copied: scripts/gpu-bench.sh run train [bench|groups|kernels]"
}

# whos: "after" (this tree's binaries), and "before" first when $DIR/before holds REV's.
whos() {
  if [ -f "$DIR/before/bin.tar.xz" ]; then echo before after; else echo after; fi
}

# unpack: the binaries of each of whos into /tmp/train-WHO ("before": $DIR/before's, "after":
# this tree's), once per run.
unpack() {
  local who
  for who in $(whos); do unpack_bins "$(from "$who")/bin.tar.xz" "/tmp/train-$who"; done
}

# from WHO: the folder WHO's binaries and revision come from; rev WHO: that revision.
from() { if [ "$1" = after ]; then echo "$DIR"; else echo "$DIR/before"; fi; }
rev() { cat "$(from "$1")/rev" 2> /dev/null || echo "?"; }

bench() {
  local out=$RESULTS_DIR/train who round rounds=1
  mkdir -p "$out"
  unpack
  [ "$(whos)" = after ] || rounds=2
  for round in $(seq "$rounds"); do
    for who in $(whos); do
      echo "== round $round: $who ($(rev "$who"))"
      "/tmp/train-$who/gpu_train_bench" "${SHAPE[@]}" --iters "$ITERS" |
        tee "$out/gpu_train_bench-$who-$round.log"
    done
  done
  [ "$PEER" = 0 ] ||
    python3 tests/reference/bench_train.py --layers "$LAYERS" --seqs 8 --seq-len 1496 --prompt-len 1226 \
      | tee "$out/bench_train.log"
  pack_results train
}

# groups: the loop's micro-batch with 1, 2, 4 (MB_GROUPS) GRPO groups of 8, --step-only, each
# process's kernel times beside its wall times; two rounds, the groups (and builds) alternating.
groups() {
  local out=$RESULTS_DIR/train who round g
  mkdir -p "$out"
  unpack
  for round in 1 2; do
    for g in $MB_GROUPS; do
      for who in $(whos); do
        echo "== round $round: $g group(s) a micro-batch, $who ($(rev "$who"))"
        ROLLPLEX_KERNEL_TIMES=1 "/tmp/train-$who/gpu_train_bench" --layers "$LAYERS" \
          --seqs $((8 * g)) "${LOOP_SHAPE[@]}" --iters 3 --step-only 2>&1 |
          tee "$out/groups-$g-$who-$round.log"
      done
    done
  done
  pack_results train
}

kernels() {
  local out=$RESULTS_DIR/train who
  mkdir -p "$out"
  unpack
  for who in $(whos); do
    echo "== $who ($(rev "$who"))"
    ncu --clock-control none --csv --metrics gpu__time_duration.sum \
      "/tmp/train-$who/gpu_train_bench" "${SHAPE[@]}" --step-only > "$out/step_ncu-$who.csv"
    python3 scripts/ncu-kernel-table.py "$out/step_ncu-$who.csv" --calls 3 --top 60 |
      tee "$out/step_kernels-$who.txt"
  done
  pack_results train
}

case "$MODE" in
  build) build ;;
  bench) bench ;;
  groups) groups ;;
  kernels) kernels ;;
  *) die "usage: $0 build|bench|groups|kernels" ;;
esac
