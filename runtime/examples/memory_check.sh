#!/usr/bin/env bash
# Device memory against the plan on one H200 (memory by data lifetime): the 3B video
# pipeline (examples/h200-3b-video.rpx) at PROMPTS prompts (default 8) without prefix dedup,
# serial and overlap, each run for 2 iterations by `rollplex-run --backend cuda --task-log`,
# which prints after each task the memory pool's bytes in use and its
# high-water mark. The summary sets each plan's device arena (its peak) beside the pool's peak
# per iteration (the metrics table's mem_GiB), and lists the tasks after which the pool dropped
# by more than 1 GiB (where the executor freed state whose plan buffers had ended).
#
# Entry point: scripts/gpu-bench.sh build memory, then scripts/gpu-bench.sh run memory.
#   1. build (on a machine with the Rust toolchain, no GPU needed) packs the binaries: plans
#      and the stripped rollplex-run into $DIR (default .gpu-pack/memory, the packed binaries,
#      ignored by git):
#        bash runtime/examples/memory_check.sh build
#   2. device (on the H200, repository root, $DIR beside it) unpacks and runs both plans,
#      writes logs and a summary in memory/, packed as $OUT/memory.tgz (about 2.5 minutes: the
#      3B models are built once per plan):
#        bash runtime/examples/memory_check.sh device
#
# Measured on 2026-12-01 at 8 prompts (docs/perf-archive-2026.md): plan peak 78.70 GiB for
# both; pool peak serial 83.28 GiB before the executor freed state at the end of its plan
# lifetime, 76.39 after; overlap 83.94 -> 82.14 GiB, then 76.58 once the gradient sums lived
# only from a mini-batch's first micro-batch to its optimizer step.
set -euo pipefail
MODE=${1:-}
DIR=${DIR:-.gpu-pack/memory}
PROMPTS=${PROMPTS:-8}
PROFILE=${PROFILE:-cost/profiles/h200-3b-runtime.yaml}
T=${CARGO_TARGET_DIR:-$PWD/target}/release

die() { echo "memory_check: $*" >&2; exit 1; }
. "$(dirname "$0")/common/gpu_pack.sh"

build() {
  cargo build --release -p rollplex-compiler --bin rollplexc
  cargo build --release -p rollplex-runtime --bin rollplex-run
  mkdir -p "$DIR"
  local src=examples/h200-3b-video.rpx f="$DIR/h3b-p$PROMPTS-off.rpx"
  grep -q '^const PROMPTS = 16 ' "$src" || die "$src: no 'const PROMPTS = 16' line to change"
  grep -q '^        host_memory = 256GiB$' "$src" || die "$src: no 'host_memory = 256GiB' line to add prefix_dedup after"
  sed -e "s/^const PROMPTS = 16 .*/const PROMPTS = $PROMPTS/" \
      -e 's/^        host_memory = 256GiB$/        host_memory = 256GiB\n        prefix_dedup = off/' "$src" > "$f"
  for m in serial overlap; do
    "$T/rollplexc" "$f" --mode $m --profile "$PROFILE" -o "$DIR/$m.plan.bin" 2>&1 | sed "s|^|$m: |"
    # the plan's device arena (its memory peak), in GiB, for the device summary
    "$T/rollplexc" explain "$DIR/$m.plan.bin" | awk '$1 == "peak:" { printf "%.2f\n", $2 / 2^30; exit }' \
      > "$DIR/$m.arena"
  done
  pack_bins "$DIR/bin.tar.xz" "$T/rollplex-run"
  du -ch "$DIR"/* | tail -1
  echo "on the GPU host, with $DIR copied: scripts/gpu-bench.sh run memory"
}

device() {
  local out=$RESULTS_DIR/memory bin=/tmp/memory-bin
  unpack_bins "$DIR/bin.tar.xz" "$bin"
  mkdir -p "$out"
  for m in serial overlap; do
    local rc=0
    timeout "${LIMIT:-150}" "$bin/rollplex-run" "$DIR/$m.plan.bin" --backend cuda --task-log \
      --iterations 2 --out "$out/$m" > "$out/$m.out" 2> "$out/$m.log" || rc=$?
    local arena; arena=$(cat "$DIR/$m.arena" 2>/dev/null || true)
    {
      echo "== $m (rollplex-run exit $rc): plan arena ${arena:-?} GiB"
      grep -E '^ *(iter|[0-9]+) ' "$out/$m.out" || true
      grep -E '^warning' "$out/$m.log" || true
      echo "tasks after which the pool dropped by more than 1 GiB:"
      awk '/^\[iteration/ { for (i = 1; i <= NF; i++) if ($i == "pool") u = $(i + 1);
             if (p != "" && p - u > 1) printf "  iteration %s, after %s: %.2f -> %.2f GiB\n", $2, $5, p, u; p = u }' "$out/$m.log"
    } | tee -a "$out/summary.txt"
  done
  pack_results memory
}

case "$MODE" in
  build) build ;;
  device) device ;;
  *) die "usage: $0 build | device (see the header)" ;;
esac
