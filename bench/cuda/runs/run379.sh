#!/usr/bin/env bash
# Session 55: the fork's memset (the form before 4cc7a10) against the committed store form, side by
# side in one run, with the bundle built from runs/run379_ab_memset.diff (BITDELTA_AB_MEMSET=1: the
# buffer zeroed at the fork, the terms added). Run 376's (b) at the larger shapes came out 4-7% above
# run 369's (memset form); part 52 chose the store form on the 7B mixed step (run 374: 11.19 / 11.03 ->
# 10.96 / 10.97 ms), level across runs (369: 10.84, 376: 10.88). Here: the 7B mixed step at batch 32
# and 16, alternated, three rounds; (b) at 4096² and 11008x4096 under each.
#   run(command="bash bench/cuda/runs/run379.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
(cd .device && tar -xJf bundle.tar.xz) || exit 1
grep -qa BITDELTA_AB_MEMSET .device/bin/bench_gpu_e2e || { echo "run379.sh: the bundle lacks the switch"; exit 1; }
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run379.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
{
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
stamp "7B model"
.device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
  --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -5 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2 3; do
  for b in 32 16; do
    for ab in 0 1; do
      [ $(( $(date +%s) - t0 )) -gt 200 ] && { stamp "left out: round $round batch $b memset $ab"; continue; }
      echo "round $round memset $ab: $(BITDELTA_AB_MEMSET=$ab timeout 60 .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 \
        --batch $b --profile-case mixed 2>&1 | grep -E '^batch' | tr '\n' ' ')"
    done
  done
done
for ab in 0 1 0 1; do
  [ $(( $(date +%s) - t0 )) -gt 280 ] && { stamp "left out: (b) memset $ab"; continue; }
  stamp "(b) memset $ab"
  BITDELTA_AB_MEMSET=$ab timeout 60 .device/bin/bench_cuda_fused_linear --many-variants 4096 4096 11008 4096 2>&1 |
    grep -E "b: roofline|route, folded, graph of 20 |route's terms alone, graph|stream base \||stream base on 64 blocks \||after a norm"
done
stamp done
} > $L 2>&1
cat $L
