#!/usr/bin/env bash
# Session 60, last call: on an H200, run392.sh (the issue's table; the bundle now from this session's
# HEAD, whose case (c) also times x just written). On any other card: the GPU tests and case (c) at the
# five shapes from the new bundle, once (a check of the bundle, ~30 s).
#   run(command="bash bench/cuda/runs/run418.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader)
if grep -q H200 <<< "$card"; then timeout 560 bash bench/cuda/runs/run392.sh; exit; fi
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
export BITDELTA_CLI_PATH=$root/.device/bin/bitdelta
{
date -u; echo "$card"
timeout 120 .device/bin/bitdelta_gpu_tests > /tmp/gt.log 2>&1; echo "GPU tests rc $?: $(tail -2 /tmp/gt.log | tr '\n' ' ')"
timeout 120 .device/bin/bench_cuda_fused_linear --prefill > $OUT/bench_c.log 2>&1; echo "(c) rc $?"
grep -E "copy of" $OUT/bench_c.log
grep -E "cuBLAS GemmEx [0-9]|cuBLAS GemmEx, x just|the engine's choice" $OUT/bench_c.log | grep "c: 512" | cut -c1-150
date -u
} > $OUT/run418.log 2>&1
cat $OUT/run418.log
