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
