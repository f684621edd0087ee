#!/usr/bin/env bash
# Session 58: the pairs as a kernel of their own (template P): blocks alone run the bundle's code
# again (run 401: the single kernel with both paths took 7-30% longer alone, the 64 x 256 tiles'
# spills); pairs by default for the tiles of two consumer warpgroups. Kernel checks, case (c) at the
# 7B's qkv and gate_up shapes and 4096 x 4096 for the bundle's build and the new one, the 7B TTFT of
# both alternated, the GPU tests.
#   run(command="bash bench/cuda/runs/run402.sh", carry=[".device/bundle.tar.xz", ".device/new.tar.xz"])
set -uo pipefail
root=$(pwd)
t0=$(date +%s)
(cd .device && tar -xJf bundle.tar.xz && mkdir -p new && tar -xJf new.tar.xz -C new) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root PATH=/usr/local/cuda/bin:$PATH
export BITDELTA_CLI_PATH=$root/.device/bin/bitdelta
L=$OUT/run402.log
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
for b in bin new; do
  echo "$b: fences and barriers in fused_gemm_kernel<true, FusedTile<2, 256>>: $(cuobjdump -sass .device/$b/bench_cuda_fused_linear 2>/dev/null |
    awk '/Function : .*fused_gemm_kernelILb1ENS1_9FusedTileILi2ELi256/{on=1;next} /Function :/{on=0} on' |
    grep -oE 'MEMBAR[.A-Z]*|FENCE[.A-Z]*|SYNCS[.A-Z0-9_]*|UCGABAR[_A-Z.]*' | sort | uniq -c | tr '\n' ' ')"
done
for b in new bin; do
  timeout 130 .device/$b/bench_cuda_fused_linear --prefill 12288 4096 22016 4096 4096 4096 > $OUT/bench_c_$b.log 2>&1
  echo "== $b: bench (c) rc $?"
  grep -E "cuBLAS GemmEx|fused GEMM (128x256 (stream|pers)|, the|64x256 persistent)" $OUT/bench_c_$b.log |
    grep "c: 512" | cut -c1-150
done
timeout 200 .device/new/test_cuda_fused_linear > $OUT/kernel_test.log 2>&1
echo "kernel checks rc $?: $(tail -1 $OUT/kernel_test.log)"; grep -m5 FAIL $OUT/kernel_test.log
echo "-- $(( $(date +%s) - t0 )) s"
[ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
  --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2; do
  for b in new bin; do
    [ $(( $(date +%s) - t0 )) -gt 400 ] && { echo "left out: $b round $round"; continue; }
    echo "== $b round $round: $(timeout 90 .device/$b/bench_gpu_e2e /tmp/l7b --decode 4 --batch 32 --requests 8 2>&1 |
      grep -A15 'TTFT of' | awk 'NR > 1 {print $1, $2}' | tr '\n' ' ')"
  done
done
[ $(( $(date +%s) - t0 )) -lt 470 ] && timeout 100 .device/new/bitdelta_gpu_tests > $OUT/gpu_tests.log 2>&1
echo "GPU tests rc $?"; grep -E "^\[  (FAILED|PASSED) " $OUT/gpu_tests.log | head
date -u
} > $L 2>&1
cat $L
