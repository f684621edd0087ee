#!/usr/bin/env bash
# Session 60: the delta's cost against K at N = 4096 (why does the delta cost so much more at K = 11008
# than at 4096, with one ring and x just written, and at 128 x 128 tiles even with x as left?): case
# (c) with x just written (--prefill-fresh-x, every form) at K = 4096, 8192, 10240, 11008, 12288,
# 16384, for the bundle (bin: two rings) and O2 (one ring: 64cf2d5's fused_linear_prefill.cu, this
# bench). On an H200, run392.sh first. .device/new.tar.xz: O2/.
#   run(command="bash bench/cuda/runs/run420.sh", carry=[".device/bundle.tar.xz", ".device/new.tar.xz"])
set -uo pipefail
root=$(pwd)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader)
(cd .device && tar -xJf bundle.tar.xz && mkdir -p new && tar -xJf new.tar.xz -C new) || exit 1
if grep -q H200 <<< "$card"; then timeout 330 bash bench/cuda/runs/run392.sh > /dev/null 2>&1; fi
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
{
date -u; echo "$card"
for b in bin new/O2; do
  timeout 150 .device/$b/bench_cuda_fused_linear --prefill-fresh-x 4096 4096 4096 8192 4096 10240 4096 11008 \
    4096 12288 4096 16384 > $OUT/c_fresh_K_${b//\//_}.log 2>&1
  echo "== $b: (c) fresh x rc $?"
  grep -E "cuBLAS GemmEx [0-9]|engine's choice|128x128 tile/block|64x256 persistent" $OUT/c_fresh_K_${b//\//_}.log |
    grep "c: 512" | cut -c1-150
done
date -u
} > $OUT/run420.log 2>&1
[ -f $OUT/run392.log ] && cat $OUT/run361main.log $OUT/run392.log
cat $OUT/run420.log
