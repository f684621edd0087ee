#!/usr/bin/env bash
# Installs what is missing, builds bitdelta from scratch in build-test/, and runs every test
# (GPU-labelled tests need a GPU machine: tools/gpu_run.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf build-test
BITDELTA_BUILD_DIR=build-test scripts/build.sh
ctest --test-dir build-test -j "$(nproc 2>/dev/null || echo 2)" --output-on-failure -LE gpu
