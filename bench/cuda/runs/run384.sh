#!/usr/bin/env bash
# Session 56: single-row slots of the delta terms kernel taking the estimate of waves that pairs of
# slot rows take (delta_terms.cu: 2 warps along K where the waves of blocks times the load batches per
# warp are no more): at 4096² and 11008x4096 with 16 single-row slots, 2 warps along K instead of 4
# (one wave of 512 blocks at 4096² instead of two). Part 35 (run 313) had 8 blocks per warp for every
# single-row slot at K = 4096: 16-row linears 2-4% faster, the batch-8 step 0.5-1% slower. The bundle
# is built from runs/run384_ab_terms_waves.diff (BITDELTA_AB_TERMS_WAVES=1: the estimate; 0: as
# committed). On an H200 run383.sh (the committed engine's table) runs first.
#   run(command="bash bench/cuda/runs/run384.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  timeout 300 bash bench/cuda/runs/run383.sh > /dev/null 2>&1
  echo "run383 rc $?" >> $OUT/run383.log
else
  (cd .device && tar -xJf bundle.tar.xz) || exit 1
fi
grep -qa BITDELTA_AB_TERMS_WAVES .device/bin/bench_gpu_e2e || { echo "run384.sh: the bundle lacks the switch"; exit 1; }
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
export BITDELTA_CLI_PATH=$root/.device/bin/bitdelta
L=$OUT/run384.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
{
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
stamp "gpu tests, the estimate on"
BITDELTA_AB_TERMS_WAVES=1 timeout 60 .device/bin/bitdelta_gpu_tests > /tmp/gt.log 2>&1; echo "rc $?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure" /tmp/gt.log | head -10
for round in 1 2; do
  for ab in 0 1; do
    stamp "(b) round $round, estimate $ab"
    BITDELTA_AB_TERMS_WAVES=$ab timeout 60 .device/bin/bench_cuda_fused_linear --many-variants 4096 4096 11008 4096 \
      > /tmp/b.log 2>&1; echo "rc $?"
    grep -E "route, folded, graph of 20 |alternated|terms alone" /tmp/b.log
  done
done
[ -d /tmp/l7b/base ] || timeout 60 .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 \
  --vocab 32000 --heads 32 --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2 3; do
  for ab in 0 1; do
    [ $(( $(date +%s) - t0 )) -gt 200 ] && { stamp "left out: round $round estimate $ab"; continue; }
    echo "round $round estimate $ab: $(BITDELTA_AB_TERMS_WAVES=$ab timeout 60 .device/bin/bench_gpu_e2e /tmp/l7b \
      --decode 16 --batch 4,8,16,32 --profile-case mixed 2>&1 | grep -E '^batch' | awk '{print $2, $6}' | tr '\n' ' ')"
  done
done
stamp done
} > $L 2>&1
cat $L
