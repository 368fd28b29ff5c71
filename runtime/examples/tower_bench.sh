#!/usr/bin/env bash
# The 3B video pipeline with the vision tower and merger trained (docs/perf.md, "tower trained"): the
# shipped examples/h200-3b-video.rpx with `freeze = []`, PROMPTS_LIST prompts (default "4 8")
# x prefix dedup on/off x serial/overlap, compiled with PROFILE, run side by side in one
# `iteration_bench` process on the H200 (3 iterations each, iteration 0 warm-up; with
# --profile-dir, so the runs' profiles can be merged into PROFILE: `rollplexc merge-profiles`).
#
# Entry point: scripts/gpu-bench.sh build tower, then scripts/gpu-bench.sh run tower.
#   1. build (on a machine with the Rust toolchain, no GPU needed) packs the binaries: plans
#      and the stripped iteration_bench into $DIR (default .gpu-pack/tower, the packed binaries,
#      ignored by git):
#        bash runtime/examples/tower_bench.sh build
#   2. device (on the H200, repository root, $DIR beside it) unpacks and runs them; writes the
#      bench log and the profiles as one file, $OUT/tower.tgz (about 4 minutes at 4 and 8 prompts):
#        bash runtime/examples/tower_bench.sh device
#      With PLACED=1 the models are built for each plan (`iteration_bench --placed`: the plan's
#      arena, buffers at its offsets, as rollplex-run does; rebuilt per plan, ~50 s each).
#
# Measured on 2026-12-01 at 8 prompts with dedup: 6.539 s (attention backward on SIMT) -> 5.442 s
# (tensor cores, heads padded 80 -> 128); docs/perf.md has the current numbers.
set -euo pipefail
MODE=${1:-}
DIR=${DIR:-.gpu-pack/tower}
PROMPTS_LIST=${PROMPTS_LIST:-4 8}
PROFILE=${PROFILE:-cost/profiles/h200-3b-runtime.yaml}
T=${CARGO_TARGET_DIR:-$PWD/target}/release

die() { echo "tower_bench: $*" >&2; exit 1; }
. "$(dirname "$0")/common/gpu_pack.sh"

build() {
  cargo build --release -p rollplex-compiler --bin rollplexc
  cargo build --release -p rollplex-runtime --example iteration_bench
  mkdir -p "$DIR"
  local src=examples/h200-3b-video.rpx
  grep -q '^const PROMPTS = 16 ' "$src" || die "$src: no 'const PROMPTS = 16' line to change"
  grep -q 'freeze = \[vision, merger\]' "$src" || die "$src: no 'freeze = [vision, merger]' to unfreeze"
  grep -q '^        host_memory = 256GiB$' "$src" || die "$src: no 'host_memory = 256GiB' line to add prefix_dedup after"
  : > "$DIR/plans.txt"
  for p in $PROMPTS_LIST; do
    for d in on off; do
      local f="$DIR/h3b-p$p-$d-tower.rpx"
      sed -e "s/^const PROMPTS = 16 .*/const PROMPTS = $p/" -e 's/freeze = \[vision, merger\].*/freeze = []/' "$src" > "$f"
      [ $d = on ] || sed -i 's/^        host_memory = 256GiB$/        host_memory = 256GiB\n        prefix_dedup = off/' "$f"
      for m in serial overlap; do
        "$T/rollplexc" "$f" --mode $m --profile "$PROFILE" -o "$DIR/p$p-$m-$d.plan.bin" 2>&1 | sed "s|^|p$p-$m-$d: |"
        echo "$DIR/p$p-$m-$d.plan.bin" >> "$DIR/plans.txt"
      done
    done
  done
  pack_bins "$DIR/bin.tar.xz" "$T/examples/iteration_bench"
  du -ch "$DIR"/* | tail -1
  echo "on the GPU host, with $DIR copied: scripts/gpu-bench.sh run tower"
}

device() {
  local out=$RESULTS_DIR/tower bin=/tmp/tower-bin
  unpack_bins "$DIR/bin.tar.xz" "$bin"
  mkdir -p "$out/prof"
  # shellcheck disable=SC2046
  timeout "${LIMIT:-500}" "$bin/iteration_bench" $(cat "$DIR/plans.txt") --iterations 3 --rounds 1 \
    --profile-dir "$out/prof" --trace-dir "$out/trace" ${PLACED:+--placed} > "$out/bench.log" 2>&1 ||
    echo "iteration_bench exit $?"
  tail -12 "$out/bench.log"
  cat "$out/prof/measured.tsv" 2>/dev/null || true
  pack_results tower
}

case "$MODE" in
  build) build ;;
  device) device ;;
  *) die "usage: $0 build | device (see the header)" ;;
esac
