#!/usr/bin/env bash
# The main job: build, compile an example pipeline, and run it.
# Without a GPU: examples/tiny.rpx on the CPU backend (a tiny Qwen2.5-VL-shaped model learns the
# moving-shapes video task by GRPO; watch the reward column rise, and held-out greedy accuracy go
# from 0 before training to ~0.9+ after). Also prints the simulator's
# predicted timeline of the single-H200 example and the plans' review form, and draws the run's
# curves (OUT/metrics.svg; TensorBoard reads OUT too).
# Knobs: ITERS (default 600: ~25-50 s of training on 2 busy cores), OUT (default ./rollplex-out).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --bins
bin="${CARGO_TARGET_DIR:-target}/release"
ITERS=${ITERS:-600}
OUT=${OUT:-rollplex-out}
mkdir -p "$OUT"

echo "== compile examples/tiny.rpx (overlap plan, YAML review form beside it)"
$bin/rollplexc examples/tiny.rpx -o "$OUT/tiny.plan.bin" --emit-yaml "$OUT/tiny.plan.yaml" --stats
echo
echo "== predicted timeline of the single-H200 3B video example (simulator)"
$bin/rollplexc examples/h200-3b-video.rpx -o "$OUT/h200-3b-video.plan.bin"
$bin/rollplex-run "$OUT/h200-3b-video.plan.bin" --backend sim --trace "$OUT/h200-3b-video.trace.json" --svg "$OUT/h200-3b-video.svg"
echo
echo "== train the tiny model: $ITERS GRPO iterations (cpu backend unless a GPU is present)"
$bin/rollplex-run "$OUT/tiny.plan.bin" --iterations "$ITERS" --out "$OUT" --eval 64
echo
echo "== the run's curves (watch a run live with: tensorboard --logdir $OUT)"
$bin/rollplex-run plot "$OUT"
