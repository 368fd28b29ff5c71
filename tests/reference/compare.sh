#!/usr/bin/env bash
# Compares Rollplex's Qwen2.5-VL forward with Hugging Face transformers on tiny random models.
#   tests/reference/compare.sh [OUT_DIR]        (default: target/reference-cases)
# Needs python with torch + transformers (PYTHON=..., default python3) and cargo.
# DEVICE=cuda runs the transformers side on a GPU (float32, eager attention either way).
# BACKEND=cuda compares our CUDA (bf16) forward with transformers in bf16 on the GPU instead
# (make_tiny_bf16.py cases, runtime/examples/gpu_reference.rs; TOL defaults to 3e-2 there).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-target/reference-cases}"
PYTHON="${PYTHON:-python3}"
if [ "${BACKEND:-cpu}" = cuda ]; then
  "$PYTHON" tests/reference/make_tiny_bf16.py "$OUT" --device cuda
  exec cargo run -q -p rollplex-runtime --example gpu_reference -- "$OUT" --tol "${TOL:-3e-2}"
fi
"$PYTHON" tests/reference/make_tiny.py "$OUT" --device "${DEVICE:-cpu}"
cargo run -q -p rollplex-runtime --example reference_forward -- "$OUT" --tol "${TOL:-1e-3}"
