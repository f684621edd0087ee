#!/usr/bin/env bash
# Session 62 (prepared, not run: no H200 came): the H200 figures that a short budget allows (about 100 s
# by run 387's stage times: (a) 11 s, (b) 29 s), on the bundle of HEAD's engine
# (a49942a's code; GPU tests and kernel checks passed on an H100 in run 425): (a) and (b) at the five
# shapes first (the issue's two open H200 figures: 4096² 3.36 TB/s against 3.4 and 1.35x against
# 1.25, both from run 376 before parts 54-59), then (c) with x just written, then the GPU tests. On any
# other card it stops at once.
#   run(command="bash bench/cuda/runs/run426.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
card=$(nvidia-smi --query-gpu=name --format=csv,noheader)
if ! grep -q H200 <<< "$card"; then echo "run426.sh: $card, not an H200: nothing run"; exit 3; fi
root=$(pwd)
t0=$(date +%s)
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
export BITDELTA_CLI_PATH=$root/.device/bin/bitdelta
source bench/cuda/runs/common.sh  # left
L=$OUT/run426.log
{
date -u; echo "$card"
timeout 80 .device/bin/bench_cuda_fused_linear --one-row 4096 4096 11008 4096 4096 11008 8192 8192 28672 8192 \
  > $OUT/bench_a.log 2>&1; echo "(a) rc $?"
grep -E "copy of|GemmEx|balanced, chain of 20 |cuBLAS, chain of 20|after a norm|after the wait  " $OUT/bench_a.log
echo "-- $(( $(date +%s) - t0 )) s"
timeout 90 .device/bin/bench_cuda_fused_linear --many-variants > $OUT/bench_b.log 2>&1; echo "(b) rc $?"
grep -E "copy of|b: roofline|route, folded, graph of 20 |alternated" $OUT/bench_b.log
echo "-- $(( $(date +%s) - t0 )) s"
left 170 "(c)" || { timeout 50 .device/bin/bench_cuda_fused_linear --prefill-fresh-x 4096 4096 11008 4096 4096 11008 \
  8192 8192 28672 8192 > $OUT/bench_c.log 2>&1; echo "(c) rc $?"
  grep -E "cuBLAS GemmEx [0-9]|engine's choice" $OUT/bench_c.log | grep "c: 512"; }
left 220 "GPU tests" || { timeout 30 .device/bin/bitdelta_gpu_tests > /tmp/gt.log 2>&1
  echo "GPU tests rc $?: $(tail -2 /tmp/gt.log | tr '\n' ' ')"; }
echo "-- $(( $(date +%s) - t0 )) s"; date -u
} > $L 2>&1
cat $L
