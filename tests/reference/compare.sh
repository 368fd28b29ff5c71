#!/usr/bin/env bash
# Compares Rollplex's Qwen2.5-VL forward with Hugging Face transformers on tiny random models.
#   tests/reference/compare.sh [OUT_DIR]        (default: target/reference-cases)
# Needs python with torch + transformers (PYTHON=..., default python3) and cargo.
# DEVICE=cuda runs the transformers side on a GPU (float32, eager attention either way).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-target/reference-cases}"
PYTHON="${PYTHON:-python3}"
"$PYTHON" tests/reference/make_tiny.py "$OUT" --device "${DEVICE:-cpu}"
cargo run -q -p rollplex-runtime --example reference_forward -- "$OUT" --tol "${TOL:-1e-3}"
