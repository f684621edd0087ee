#!/usr/bin/env bash
# Session 52: the one-row kernel without the stage where a warp has one round of units (4096² of the
# five shapes; committed after run 368). The two PTX builds' GPU tests and kernel checks (run361.sh's
# part p), then, on an H200 only, (a) at 4096² in five rounds (chains, graphs, step form), for a median
# against run 369's single round (10.62 µs in graphs of pairs) and run 368's three (10.45-10.47).
#   run(command="bash bench/cuda/runs/run370.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
bash bench/cuda/runs/run361.sh p > /dev/null 2>&1
cp $OUT/run361p.log $OUT/run370p.log && rm $OUT/run361p.log
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run370.log
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  for round in 1 2 3 4 5; do
    echo "-- round $round"
    .device/bin/bench_cuda_fused_linear --one-row 4096 4096 > /tmp/a.log 2>&1
    grep -E "copy of|floor.*after the wait  |balanced, chain of 20 |after a norm|graph of 20" /tmp/a.log
  done
else
  echo "not an H200: (a) rounds left out"
fi
} > $L 2>&1
cat $OUT/run370p.log $L
