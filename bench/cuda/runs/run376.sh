#!/usr/bin/env bash
# Session 54: the issue-6 table on the committed code (4cc7a10: the delta terms beside the GEMM
# written, not added; its GPU form and its kernel check "delta store" never ran before): run361.sh's
# main part, whose kernel checks include "delta store", then, on an H200 only, four more rounds of (a)
# at 4096² (for a median of five with main's) and two more of (b) at 4096² and 11008x4096; then, if
# the call has run under 330 s, run361.sh's part p (the two PTX builds' tests, about 210 s).
# Session 55: the (b) rows now include the streaming base taking 1, 2 or 4 variants' terms itself
# beside the terms of the rest (bench_fused_linear.cpp, kFusedShift), issued first, and on 64 or 32
# blocks, alternated with the plain streaming base | terms, twice per shape.
#   run(command="bash bench/cuda/runs/run376.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
t0=$(date +%s)
timeout 480 bash bench/cuda/runs/run361.sh main > /dev/null 2>&1
echo "run361 main rc $?" >> $OUT/run361main.log
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run376.log
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
grep -cE "^ok +delta store" /tmp/kt.log; grep -E "delta store" /tmp/kt.log | head -3
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  for round in 2 3 4 5; do
    echo "-- (a) round $round, $(( $(date +%s) - t0 )) s"
    timeout 40 .device/bin/bench_cuda_fused_linear --one-row 4096 4096 > /tmp/a.log 2>&1
    grep -E "copy of|floor.*after the wait  |balanced, chain of 20 |after a norm|graph of 20" /tmp/a.log
  done
  for round in 2 3; do
    echo "-- (b) round $round, $(( $(date +%s) - t0 )) s"
    timeout 60 .device/bin/bench_cuda_fused_linear --many-variants 4096 4096 11008 4096 > /tmp/b.log 2>&1
    grep -E "copy of|b: roofline|route, folded, graph of 20 |alone, graph of 20 |after a norm|stream kernel base \||stream base" /tmp/b.log
  done
else
  echo "not an H200: extra rounds left out"
fi
echo "-- done, $(( $(date +%s) - t0 )) s"
} > $L 2>&1
cat $OUT/run361main.log $L
if [ $(( $(date +%s) - t0 )) -lt 330 ]; then
  timeout 240 bash bench/cuda/runs/run361.sh p > /dev/null 2>&1
  echo "run361 p rc $?" >> $OUT/run361p.log
  cat $OUT/run361p.log
else
  echo "part p left out (time)"
fi
