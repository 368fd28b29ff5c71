#!/usr/bin/env bash
# Installs what the build needs on a fresh Debian/Ubuntu machine that has only the Rust
# toolchain: HiGHS (the ILP solver, built from source by highs-sys) needs cmake and libclang.
set -euo pipefail
need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
# bindgen loads libclang.so or libclang-N.so (libclang-cpp.so, which some machines have without
# it, does not do)
if ! ls /usr/lib/llvm-*/lib/libclang.so* /usr/lib/llvm-*/lib/libclang-[0-9]*.so* \
    /usr/lib/x86_64-linux-gnu/libclang.so* /usr/lib/x86_64-linux-gnu/libclang-[0-9]*.so* >/dev/null 2>&1; then
  need+=(libclang-dev)
fi
command -v c++ >/dev/null 2>&1 || need+=(g++)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
