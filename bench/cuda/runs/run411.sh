#!/usr/bin/env bash
# Session 59: run 410 found F's 64-token 7B prompt 0.1-0.4 ms slower than the bundle's one ring (x's lead 3
# stages of 8 KB there, W's 19). G: x's ring leads by 96 KB (3 stages of 256-row tiles, as F; 4 of
# 128 x 176, 6 of 128 x 128, 12 of 64 x 64), W's takes the rest. G's kernel checks, then the 7B TTFT of
# 64- and 128-token prompts, G and the bundle's build (bin) alternated in two rounds.
#   run(command="bash bench/cuda/runs/run411.sh", carry=[".device/bundle.tar.xz", ".device/new.tar.xz"])
set -uo pipefail
root=$(pwd)
t0=$(date +%s)
(cd .device && tar -xJf bundle.tar.xz && mkdir -p new && tar -xJf new.tar.xz -C new) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run411.log
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
[ -d /tmp/l7b/base ] || .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 \
  --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2; do
  for p in 64 128; do
    for b in new/G bin; do
      [ $(( $(date +%s) - t0 )) -gt 150 ] && { echo "left out: $b prompt $p round $round"; continue; }
      echo "== $b prompt $p round $round: $(timeout 40 .device/$b/bench_gpu_e2e /tmp/l7b --prompt $p --decode 4 --batch 32 \
        --requests 8 2>&1 | grep -A15 'TTFT of' | awk 'NR > 1 {print $1, $2}' | tr '\n' ' ')"
    done
  done
done
echo "-- $(( $(date +%s) - t0 )) s"
timeout 80 .device/new/G/test_cuda_fused_linear > $OUT/kernel_test.log 2>&1
echo "G kernel checks rc $?: $(tail -1 $OUT/kernel_test.log)"; grep -m3 FAIL $OUT/kernel_test.log
echo "-- $(( $(date +%s) - t0 )) s"; date -u
} > $L 2>&1
cat $L
