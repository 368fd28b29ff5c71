#!/usr/bin/env bash
# Installs what the build needs on a fresh Debian/Ubuntu machine that has only the Rust
# toolchain: HiGHS (the ILP solver, built from source by highs-sys) needs cmake and libclang.
set -euo pipefail
need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
if ! ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 && ! ls /usr/lib/x86_64-linux-gnu/libclang*.so* >/dev/null 2>&1; then
  need+=(libclang-dev)
fi
command -v c++ >/dev/null 2>&1 || need+=(g++)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
