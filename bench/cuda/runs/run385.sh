#!/usr/bin/env bash
# Session 56: the committed engine (the route's base through the streaming kernel, 56ce9ee; single-row
# slots of the delta terms taking the estimate of waves, run 384): the kernel checks (with a new case,
# 16 single-row slots at 4096², the form the estimate changes) and the GPU tests; then on an H200
# run383.sh (the table: (b) at five shapes, the 7B table, the server), elsewhere (b) alone.
#   run(command="bash bench/cuda/runs/run385.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
export BITDELTA_CLI_PATH=$root/.device/bin/bitdelta
L=$OUT/run385.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
{
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
stamp "kernel tests"
timeout 150 .device/bin/test_cuda_fused_linear > /tmp/kt.log 2>&1; echo "rc $?"
grep -E "^FAIL" /tmp/kt.log | head -20; grep -E "4096x4096" /tmp/kt.log | grep -i "delta" | head -6; tail -1 /tmp/kt.log
stamp "gpu tests"
timeout 60 .device/bin/bitdelta_gpu_tests > /tmp/gt.log 2>&1; echo "rc $?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure" /tmp/gt.log | head -10
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  stamp "(b) many-variants bench (not an H200: the table left out)"
  timeout 90 .device/bin/bench_cuda_fused_linear --many-variants > $OUT/bench_b.log 2>&1; echo "rc $?"
  grep -E "copy of|route, folded, graph of 20 |alternated|terms alone" $OUT/bench_b.log
fi
stamp done
} > $L 2>&1
cat $L
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  timeout 300 bash bench/cuda/runs/run383.sh
fi
