#!/usr/bin/env bash
# The CUDA training step at the RL loop's micro-batch shape (docs/perf.md, "Training step"):
# gpu_train_bench with 8 layers of the 3B widths and one GRPO group of 8 (prompt 1,226 tokens,
# responses 271: the 3B video job's micro-batch), then where its time goes, kernel by kernel.
#
# Entry point: scripts/gpu-bench.sh build train, then scripts/gpu-bench.sh run train [bench|kernels].
#   1. build (on a machine with the Rust toolchain, no GPU needed) packs the stripped
#      gpu_train_bench into $DIR (default .gpu-pack/train, the packed binaries, ignored by git):
#        bash runtime/examples/train_bench.sh build
#   2. on the GPU host (repository root, $DIR beside it):
#        bash runtime/examples/train_bench.sh bench     # the step's times and parts, PyTorch's beside it
#        bash runtime/examples/train_bench.sh kernels   # Nsight Compute: one micro-batch's kernels,
#                                                       # microseconds each (--step-only: 3 equal calls)
#      Logs under $RESULTS_DIR/train (packed as $OUT/train.tgz when OUT is set).
# Knobs: LAYERS (8), ITERS (5).
set -euo pipefail
MODE=${1:-}
DIR=${DIR:-.gpu-pack/train}
LAYERS=${LAYERS:-8}
ITERS=${ITERS:-5}
T=${CARGO_TARGET_DIR:-$PWD/target}/release

die() { echo "train_bench: $*" >&2; exit 1; }
. "$(dirname "$0")/common/gpu_pack.sh"

SHAPE=(--layers "$LAYERS" --seqs 8 --seq-len 1496 --prompt-len 1226 --group 8)

build() {
  cargo build --release -p rollplex-runtime --example gpu_train_bench
  mkdir -p "$DIR"
  pack_bins "$DIR/bin.tar.xz" "$T/examples/gpu_train_bench"
  du -h "$DIR/bin.tar.xz"
  echo "on the GPU host, with $DIR copied: scripts/gpu-bench.sh run train [bench|kernels]"
}

bench() {
  local bin=/tmp/train-bin out=$RESULTS_DIR/train
  unpack_bins "$DIR/bin.tar.xz" "$bin"
  mkdir -p "$out"
  "$bin/gpu_train_bench" "${SHAPE[@]}" --iters "$ITERS" | tee "$out/gpu_train_bench.log"
  python3 tests/reference/bench_train.py --layers "$LAYERS" --seqs 8 --seq-len 1496 --prompt-len 1226 \
    | tee "$out/bench_train.log"
  pack_results train
}

kernels() {
  local bin=/tmp/train-bin out=$RESULTS_DIR/train
  unpack_bins "$DIR/bin.tar.xz" "$bin"
  mkdir -p "$out"
  ncu --clock-control none --csv --metrics gpu__time_duration.sum \
    "$bin/gpu_train_bench" "${SHAPE[@]}" --step-only > "$out/step_ncu.csv"
  python3 scripts/ncu-kernel-table.py "$out/step_ncu.csv" --calls 3 --top 60 | tee "$out/step_kernels.txt"
  pack_results train
}

case "$MODE" in
  build) build ;;
  bench) bench ;;
  kernels) kernels ;;
  *) die "usage: $0 build|bench|kernels" ;;
esac
