# Sourced by the GPU benchmark scripts (runtime/examples: arena_bench.sh, train_bench.sh,
# memory_check.sh, tower_bench.sh, corun_calibrate.sh; kernels/examples/gpu_check.sh; entry
# point scripts/gpu-bench.sh): `build`, on a machine with the Rust toolchain, packs the
# binaries stripped into one tarball in the benchmark's .gpu-pack/ folder (the packed
# binaries); `run`, on the GPU host, unpacks and runs them.

# pack_bins TARBALL FILE...: FILEs (built binaries) stripped into the xz tarball TARBALL.
pack_bins() {
  local tarball=$1 tmp; shift
  tmp=$(mktemp -d)
  local names=()
  for f in "$@"; do
    cp "$f" "$tmp/" && strip "$tmp/$(basename "$f")"
    names+=("$(basename "$f")")
  done
  tar cJf "$tarball" -C "$tmp" "${names[@]}"
  rm -rf "$tmp"
}

# build_rev REV ARGS...: `cargo build --release ARGS` of revision REV, in a temporary git
# worktree, into a target directory of its own (target/before, so that neither build's
# binaries stand in for the other's); prints that directory's release folder. One cargo
# invocation a call (the worktree is cheap, the target directory keeps the build incremental).
build_rev() {
  local rev=$1 wt bt rc=0
  shift
  bt=$(realpath -m "${CARGO_TARGET_DIR:-target}")/before
  wt=$(mktemp -d)/rev
  git worktree add --detach "$wt" "$rev" > /dev/null || return 1
  (cd "$wt" && CARGO_TARGET_DIR="$bt" cargo build --release "$@") >&2 || rc=$?
  git worktree remove --force "$wt"
  [ $rc -ne 0 ] || echo "$bt/release"
  return $rc
}

# unpack_bins TARBALL DEST: the binaries of TARBALL into DEST; the kernel cache where the
# device scripts keep it (unless set).
unpack_bins() {
  [ -f "$1" ] || die "$1 missing: build the binaries on a machine with the Rust toolchain (scripts/gpu-bench.sh build ...) and copy $(dirname "$1") here"
  mkdir -p "$2"
  tar xJf "$1" -C "$2"
  export ROLLPLEX_KERNEL_CACHE=${ROLLPLEX_KERNEL_CACHE:-/tmp/rk}
}

# Device runs write under $RESULTS_DIR/NAME (RESULTS_DIR: /tmp/rollplex-out unless set).
RESULTS_DIR=${RESULTS_DIR:-/tmp/rollplex-out}

# pack_results NAME: $RESULTS_DIR/NAME as the one file $OUT/NAME.tgz, so that a directory of
# profiles and traces travels back from the GPU host as one file; unpack it with
# `tar xzf NAME.tgz`. Without OUT the results stay in $RESULTS_DIR.
pack_results() {
  [ -n "${OUT:-}" ] || { echo "results in $RESULTS_DIR/$1"; return 0; }
  tar czf "$OUT/$1.tgz" -C "$RESULTS_DIR" "$1"
  echo "results: \$OUT/$1.tgz ($(du -h "$OUT/$1.tgz" | cut -f1); tar xzf $1.tgz gives $1/)"
}
