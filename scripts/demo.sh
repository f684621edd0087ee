#!/usr/bin/env bash
# The main job (until the server exists): build, then compress each bundled demo fine-tune against
# the demo base into build/demo/NAME.bitdelta and describe the result.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh >/dev/null
demo=models/demo
if [ ! -f "$demo/base/config.json" ]; then
  echo "demo: $demo/base is missing (see models/demo/README.md to regenerate the demo family)" >&2
  exit 1
fi
mkdir -p build/demo
for variant in coder math writer legal; do
  [ -d "$demo/$variant" ] || continue
  build/bitdelta compress "$demo/base" "$demo/$variant" -o "build/demo/$variant.bitdelta"
  echo
done
build/bitdelta inspect build/demo/coder.bitdelta | head -12
