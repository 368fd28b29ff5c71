#!/usr/bin/env bash
# The test command: unit, golden, property and end-to-end CPU tests of the whole workspace.
# GPU tests run only where a CUDA device is present and print why they skip otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo test --workspace --release "$@"
