#!/usr/bin/env bash
# The GPU benchmarks and checks, in two steps:
#
#   scripts/gpu-bench.sh build BENCH          on a machine with the Rust toolchain (no GPU needed):
#                                             builds the release binaries (and plans) BENCH needs
#                                             and packs them, stripped, into .gpu-pack/ (the packed
#                                             binaries, git-ignored)
#   scripts/gpu-bench.sh run BENCH [ARGS...]  on a GPU host, in the repository root with .gpu-pack/
#                                             copied beside it: unpacks the binaries and runs them
#                                             (no Rust toolchain needed there)
#
# BENCH                     script                                  run ARGS (default)
#   kernels                 kernels/examples/gpu_check.sh           tests tests-decode sanitize gemm decode torch
#                                                                   (tests sanitize gemm decode torch)
#   dprefix                 kernels/examples/dprefix_check.sh       tests simt-env sanitize racecheck bench bench-full
#                                                                   (tests simt-env sanitize bench)
#   vision-bwd              runtime/examples/vision_bwd_check.sh    kernel vision forward sanitize (all four)
#   arena                   runtime/examples/arena_bench.sh         tests bench (both)
#   train                   runtime/examples/train_bench.sh         bench groups kernels (bench)
#   tower                   runtime/examples/tower_bench.sh         -
#   offload                 runtime/examples/offload_bench.sh       serial overlap stream host big host-3b
#                                                                   (serial overlap)
#   memory                  runtime/examples/memory_check.sh        -
#   corun                   runtime/examples/corun_calibrate.sh     -  (then, back on the build machine:
#                                                                   runtime/examples/corun_calibrate.sh offline RESULTS)
#
# Each script's header says what it measures, its knobs (environment) and where its results go:
# logs under $RESULTS_DIR or $OUT (default /tmp/rollplex-out); with OUT set, the runtime
# benchmarks also pack their results as one file $OUT/NAME.tgz. docs/perf.md quotes what they
# measured.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2
  exit "${1:-2}"
}

[ $# -ge 2 ] || usage
step=$1 bench=$2
shift 2
case "$step" in
  build | run) ;;
  -h | --help | help) usage 0 ;;
  *) echo "gpu-bench: unknown step '$step' (build or run)" >&2; usage ;;
esac

case "$bench" in
  kernels) script=kernels/examples/gpu_check.sh ;;
  dprefix) script=kernels/examples/dprefix_check.sh ;;
  vision-bwd) script=runtime/examples/vision_bwd_check.sh ;;
  arena) script=runtime/examples/arena_bench.sh ;;
  train) script=runtime/examples/train_bench.sh ;;
  tower) script=runtime/examples/tower_bench.sh ;;
  offload) script=runtime/examples/offload_bench.sh ;;
  memory) script=runtime/examples/memory_check.sh ;;
  corun) script=runtime/examples/corun_calibrate.sh ;;
  *) echo "gpu-bench: unknown benchmark '$bench'" >&2; usage ;;
esac

if [ "$step" = build ]; then
  [ $# -eq 0 ] || { echo "gpu-bench: build takes no arguments after BENCH" >&2; exit 2; }
  exec bash "$script" build
fi

case "$bench" in
  # step lists: the script runs the steps it is given, or its defaults
  kernels | dprefix | vision-bwd) exec bash "$script" "$@" ;;
  offload) exec bash "$script" device "$@" ;;
  arena | train)
    modes=("$@")
    if [ ${#modes[@]} -eq 0 ]; then
      if [ "$bench" = arena ]; then modes=(tests bench); else modes=(bench); fi
    fi
    for m in "${modes[@]}"; do
      bash "$script" "$m"
    done ;;
  tower | memory | corun)
    [ $# -eq 0 ] || { echo "gpu-bench: run $bench takes no arguments (its knobs are environment variables)" >&2; exit 2; }
    exec bash "$script" device ;;
esac
