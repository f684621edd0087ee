#!/usr/bin/env bash
# Installs what is missing, builds bitdelta from scratch in build-test/, and runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
jobs=$(nproc 2>/dev/null || echo 2)
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
rm -rf build-test
cmake -S . -B build-test "${gen[@]}" -DCMAKE_BUILD_TYPE=Release
cmake --build build-test -j "$jobs"
ctest --test-dir build-test -j "$jobs" --output-on-failure -LE gpu
