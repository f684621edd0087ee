#!/usr/bin/env bash
# Session 57: case (c) of bench_cuda_fused_linear (512 rows of one variant, every fused GEMM form
# against cuBLAS) at the 7B model's fused prompt shapes, qkv 12288 x 4096 and gate_up 22016 x 4096,
# which the five shapes do not include: whether 128 x 176 tiles on persistent blocks (97.7% of
# the waves' work useful at 22016) beat the rule's 128 x 256 stream-K there (runs 390-394: the fused
# prompt GEMMs 1.28x cuBLAS per layer on H100s).
#   run(command="bash bench/cuda/runs/run396.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 .device/bin/bench_cuda_fused_linear --prefill 22016 4096 12288 4096 > $OUT/run396_bench_c.log 2>&1
echo "rc $?"
grep -E "cuBLAS GemmEx|fused GEMM (128x176|128x256|64x256|, the)" $OUT/run396_bench_c.log | grep -v portable | cut -c1-130
