#!/usr/bin/env bash
# Session 56, for the next session: the whole issue-6 table on the committed code (the route's base
# through the streaming kernel, 56ce9ee; single-row slots on the waves estimate, 1d39362; the terms'
# warps along K as a bench knob, so (b) times the route with the terms on 4 and 8 warps along K beside
# the estimate's choice: the side-by-side run 386 was prepared for, without a switch build). One call:
# run361.sh main (GPU tests, kernel checks, (a), (b), (c), the 7B table, the server), the 7B mixed step
# at batch 4, 8, 16 and 32 in two rounds, then run361.sh p (the compute_80 and compute_90 PTX
# builds' tests). The bundle: `tools/device_bundle.sh` (with the PTX builds).
#   run(command="bash bench/cuda/runs/run387.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
t0=$(date +%s)
timeout 300 bash bench/cuda/runs/run361.sh main > /dev/null 2>&1
echo "run361 main rc $?" >> $OUT/run361main.log
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
ls .device/bin-ptx/bitdelta_gpu_tests > /dev/null || echo "run387.sh: the bundle has no PTX builds" >> $OUT/run361main.log
L=$OUT/run387.log
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
grep -E "warps along K|route, folded, graph of 20 |alternated" $OUT/bench_b.log
for round in 1 2; do
  [ $(( $(date +%s) - t0 )) -gt 330 ] && { echo "left out: mixed round $round"; continue; }
  echo "mixed round $round: $(timeout 60 .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --batch 4,8,16,32 \
    --profile-case mixed 2>&1 | grep -E '^batch' | awk '{print $2, $6}' | tr '\n' ' ')"
done
echo "-- $(( $(date +%s) - t0 )) s"
} > $L 2>&1
timeout 240 bash bench/cuda/runs/run361.sh p > /dev/null 2>&1
echo "run361 p rc $?" >> $OUT/run361p.log
rm -f $OUT/gpu_tests.log $OUT/portable_gpu_tests.log $OUT/portable90_gpu_tests.log  # summaries in run361*.log
cat $OUT/run361main.log $L $OUT/run361p.log
