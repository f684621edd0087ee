#!/usr/bin/env bash
# The main job: build, then serve the bundled demo family (models/demo: the base and its coder, math,
# writer and legal variants, each a 1-bit delta) through the OpenAI-compatible API on
# http://127.0.0.1:8080. Extra arguments go to `bitdelta serve` (e.g. --port 9000).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh >/dev/null
exec build/bitdelta serve "$@"
