#!/usr/bin/env bash
# Installs what is missing, then configures and builds bitdelta (Release) in build/ (or in
# $BITDELTA_BUILD_DIR). Usage: scripts/build.sh [extra cmake args]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
dir=${BITDELTA_BUILD_DIR:-build}
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
if [ ! -f "$dir/CMakeCache.txt" ]; then
  cmake -S . -B "$dir" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release "$@"
fi
cmake --build "$dir" -j "$(nproc 2>/dev/null || echo 2)"
