# Sourced by the build-here / run-there scripts of runtime/examples (memory_check.sh,
# tower_bench.sh, corun_calibrate.sh): binaries built here travel to the GPU machine stripped,
# in one tarball inside the carried directory.

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

# unpack_bins TARBALL DEST: the binaries of TARBALL into DEST; the kernel cache where the
# device scripts keep it (unless set).
unpack_bins() {
  [ -f "$1" ] || die "$1 missing: run 'build' here and carry $(dirname "$1")"
  mkdir -p "$2"
  tar xJf "$1" -C "$2"
  export ROLLPLEX_KERNEL_CACHE=${ROLLPLEX_KERNEL_CACHE:-/tmp/rk}
}

# Device runs write under $RESULTS_DIR/NAME (RESULTS_DIR: /tmp/rollplex-out unless set).
RESULTS_DIR=${RESULTS_DIR:-/tmp/rollplex-out}

# pack_results NAME: $RESULTS_DIR/NAME as the one file $OUT/NAME.tgz (the device tool brings back
# at most 8 files from $OUT, so a directory of profiles and traces would come back cut short);
# unpack it here with `tar xzf NAME.tgz`. Without OUT (a run by hand) the results stay put.
pack_results() {
  [ -n "${OUT:-}" ] || { echo "results in $RESULTS_DIR/$1"; return 0; }
  tar czf "$OUT/$1.tgz" -C "$RESULTS_DIR" "$1"
  echo "results: \$OUT/$1.tgz ($(du -h "$OUT/$1.tgz" | cut -f1); tar xzf $1.tgz gives $1/)"
}
