#!/usr/bin/env bash
# Session 60: case (c) at the issue's five shapes with the bench that now also times the engine's
# choice and cuBLAS with x copied into place before each call ("x just written", as a model's prompt
# finds it; run 414: one ring's 4096 x 11008 then takes 1.47x cuBLAS, as in the model), for two rings
# (T2: the committed kernel) and one (O2: 64cf2d5's fused_linear_prefill.cu), both with this bench,
# alternated in two rounds; then 64 and 128 rows (--prefill-rows) at o's, down's, qkv's and gate/up's
# shapes, once each. On an H200, run392.sh first. .device/new.tar.xz: T2/, O2/.
#   run(command="bash bench/cuda/runs/run415.sh", carry=[".device/bundle.tar.xz", ".device/new.tar.xz"])
set -uo pipefail
root=$(pwd)
t0=$(date +%s)
export PATH=/usr/local/cuda/bin:$PATH
card=$(nvidia-smi --query-gpu=name --format=csv,noheader)
(cd .device && tar -xJf bundle.tar.xz && mkdir -p new && tar -xJf new.tar.xz -C new) || exit 1
if grep -q H200 <<< "$card"; then timeout 330 bash bench/cuda/runs/run392.sh > /dev/null 2>&1; fi
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run415.log
{
date -u; echo "$card"
for round in 1 2; do
  for b in T2 O2; do
    timeout 150 .device/new/$b/bench_cuda_fused_linear --prefill > $OUT/c_${b}_$round.log 2>&1
    echo "== $b round $round: (c) rc $?"
    grep -E "copy of" $OUT/c_${b}_$round.log
    grep -E "cuBLAS GemmEx [0-9]|cuBLAS GemmEx, x just|the engine's choice" $OUT/c_${b}_$round.log | grep "c: 512" | cut -c1-150
  done
done
echo "-- $(( $(date +%s) - t0 )) s"
for rows in 64 128; do
  for b in T2 O2; do
    [ $(( $(date +%s) - t0 )) -gt 500 ] && { echo "left out: $rows rows of $b"; continue; }
    timeout 100 .device/new/$b/bench_cuda_fused_linear --prefill-rows $rows 4096 4096 4096 11008 12288 4096 22016 4096 \
      > /tmp/r.log 2>&1
    echo "== $b: $rows rows rc $?"
    grep -E "cuBLAS GemmEx [0-9]|cuBLAS GemmEx, x just|the engine's choice" /tmp/r.log | grep "c: $rows" | cut -c1-150
  done
done
echo "-- $(( $(date +%s) - t0 )) s"; date -u
} > $L 2>&1
[ -f $OUT/run392.log ] && cat $OUT/run361main.log $OUT/run392.log
cat $L
