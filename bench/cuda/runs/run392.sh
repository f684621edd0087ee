#!/usr/bin/env bash
# Session 57: the issue's table on an H200 for the committed code, within what device time is left
# (about 300 s): run361.sh main (GPU tests, kernel checks, (a), (b) with the rows of the terms' warps
# along K, (c), the 7B table with the cold load's split, the server) and the 7B mixed step at batch 4,
# 8, 16 and 32 in two rounds; not the PTX builds (run 387 ran them on an H100). On any other card it
# stops at once. The bundle: tools/device_bundle.sh.
#   run(command="bash bench/cuda/runs/run392.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
card=$(nvidia-smi --query-gpu=name --format=csv,noheader)
if ! grep -q H200 <<< "$card"; then echo "run392.sh: $card, not an H200: nothing run"; exit 3; fi
root=$(pwd)
t0=$(date +%s)
timeout 300 bash bench/cuda/runs/run361.sh main > /dev/null 2>&1
echo "run361 main rc $?" >> $OUT/run361main.log
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run392.log
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
grep -E "warps along K|route, folded, graph of 20 |alternated" $OUT/bench_b.log
grep -E "cold load|floor:" /tmp/e2e.log
for round in 1 2; do
  [ $(( $(date +%s) - t0 )) -gt 300 ] && { echo "left out: mixed round $round"; continue; }
  echo "mixed round $round: $(timeout 60 .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --batch 4,8,16,32 \
    --profile-case mixed 2>&1 | grep -E '^batch' | awk '{print $2, $6}' | tr '\n' ' ')"
done
echo "-- $(( $(date +%s) - t0 )) s"
} > $L 2>&1
rm -f $OUT/gpu_tests.log
cat $OUT/run361main.log $L
