#!/usr/bin/env bash
# Compares Rollplex's training gradients with PyTorch autograd of transformers' Qwen2.5-VL under
# the GRPO loss, on the tiny random checkpoints of make_tiny.py.
#   tests/reference/grad_compare.sh [OUT_DIR]        (default: target/grad-cases)
# Needs python with torch + transformers (PYTHON=..., default python3) and cargo.
# DEVICE=cuda runs the PyTorch side on a GPU (float32, TF32 off); AGG picks the aggregation
# (token_mean, seq_mean_token_mean, seq_mean_token_sum); TOL the per-tensor relative L2 bound.
# BACKEND=cuda compares our CUDA trainer (bf16, the whole actor trained: every tensor) with
# PyTorch in bfloat16 on the GPU (make_tiny_bf16's cases; the bound is 3x PyTorch's own bf16
# error against its float32 run, or TOL, default 1e-2); needs a CUDA device.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-target/grad-cases}"
PYTHON="${PYTHON:-python3}"
if [ "${BACKEND:-cpu}" = cuda ]; then
  "$PYTHON" tests/reference/grad_compare.py "$OUT" --device cuda --dtype bfloat16 --agg "${AGG:-token_mean}"
  cargo run -q --release -p rollplex-runtime --example grad_compare -- "$OUT" --backend cuda --tol "${TOL:-1e-2}" --quiet
else
  "$PYTHON" tests/reference/grad_compare.py "$OUT" --device "${DEVICE:-cpu}" --agg "${AGG:-token_mean}"
  cargo run -q -p rollplex-runtime --example grad_compare -- "$OUT" --tol "${TOL:-1e-3}" --quiet
fi
