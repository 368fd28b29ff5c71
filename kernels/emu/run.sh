#!/usr/bin/env bash
# Runs cuda/attention_bwd_tc.cu's kernels on the CPU (no GPU, no CUDA toolkit: g++ and python3)
# under emu.h's emulation of blocks, warps, ldmatrix, mma.sync and cp.async, and checks them
# against a double-precision reference (bwd_tc_check.cpp). Catches indexing, masking, pipeline
# and reduction errors before device time is spent; says nothing about speed, and the fp32
# accumulation order of an emulated mma is not the hardware's.
# Usage: bash kernels/emu/run.sh [SOURCE.cu]    (FULL=1 adds hd 128 with 16/2 heads, ~4 min)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=${1:-$here/../cuda/attention_bwd_tc.cu}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 "$here/gen.py" "$src" "$here/../cuda/common.cuh" "$work/kern.cu"
cfgs=("64 4" "128 4")
[ "${FULL:-0}" = 1 ] && cfgs+=("128 16")
for cfg in "${cfgs[@]}"; do
  read -r hd heads <<< "$cfg"
  echo "== head_dim $hd, $heads heads / 2 kv heads"
  g++ -std=c++17 -O2 -DHEAD_DIM="$hd" -DHEADS="$heads" -w -I"$work" -I"$here" \
    -o "$work/check_$hd" "$here/bwd_tc_check.cpp"
  "$work/check_$hd"
done
