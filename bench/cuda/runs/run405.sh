#!/usr/bin/env bash
# Session 58: the fused GEMM with two rings, W's (and the signs') of 5-20 stages released once the
# fragments are in registers, x's of 4 released once their wgmma retired (run 403: with one ring of 4
# stages the consumers waited on their stages' copies in a third of the samples, the producer on
# free slots). The new build (.device/new.tar.xz): its kernel checks; case (c) at the 7B's qkv shape
# and 4096 x 4096 for the bundle's build and the new one; the 7B TTFT of both.
#   run(command="bash bench/cuda/runs/run405.sh", carry=[".device/bundle.tar.xz", ".device/new.tar.xz"])
set -uo pipefail
root=$(pwd)
t0=$(date +%s)
(cd .device && tar -xJf bundle.tar.xz && mkdir -p new && tar -xJf new.tar.xz -C new) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run405.log
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 .device/new/test_cuda_fused_linear > $OUT/kernel_test.log 2>&1
echo "kernel checks rc $?: $(tail -1 $OUT/kernel_test.log)"; grep -m5 FAIL $OUT/kernel_test.log
for b in new bin; do
  timeout 70 .device/$b/bench_cuda_fused_linear --prefill 12288 4096 4096 4096 > $OUT/bench_c_$b.log 2>&1
  echo "== $b: bench (c) rc $?"
  grep -E "cuBLAS GemmEx|fused GEMM" $OUT/bench_c_$b.log | grep "c: 512" | grep -vE "portable|tile/block" | cut -c1-150
done
echo "-- $(( $(date +%s) - t0 )) s"
[ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
  --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2; do
  for b in new bin; do
    [ $(( $(date +%s) - t0 )) -gt 240 ] && { echo "left out: $b round $round"; continue; }
    echo "== $b round $round: $(timeout 60 .device/$b/bench_gpu_e2e /tmp/l7b --decode 4 --batch 32 --requests 8 2>&1 |
      grep -A15 'TTFT of' | awk 'NR > 1 {print $1, $2}' | tr '\n' ' ')"
  done
done
date -u
} > $L 2>&1
cat $L
