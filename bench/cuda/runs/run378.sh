#!/usr/bin/env bash
# Session 55: (b)'s route at 4096² (and 11008x4096) on one timeline: the streaming base's and the
# delta terms' blocks, per form (bench_cuda_fused_linear --route-trace, a -DBITDELTA_STREAM_TRACE=ON
# build of the bench, carried xz-compressed beside the bundle for its libraries). Why run 376's forms
# order as they do: terms captured first 20.2 µs, base captured first 22.5, x quantized before 22.5.
#   run(command="bash bench/cuda/runs/run378.sh",
#       carry=[".device/bundle.tar.xz", ".device/trace/bench_cuda_fused_linear.xz"])
set -uo pipefail
root=$(pwd)
(cd .device && tar -xJf bundle.tar.xz) || exit 1
xz -dkf .device/trace/bench_cuda_fused_linear.xz || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run378.log
{
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 120 .device/trace/bench_cuda_fused_linear --route-trace 4096 4096 11008 4096; echo "rc $?"
date -u
} > $L 2>&1
cat $L
