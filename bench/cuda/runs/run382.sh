#!/usr/bin/env bash
# Session 56: the route's base through the streaming kernel (run 381 on an H100: it beat cuBLAS in the
# 7B mixed step at batch 16 and 32), its blocks beside the terms chosen by measurement. The bundle is
# built with runs/run382_ab.diff: BITDELTA_AB_STREAM_BASE=0 cuBLAS takes the base (the engine until
# now), 1 the streaming kernel on its own grid, 2 on min(tiles, SMs / 2) blocks, 3 on min(tiles,
# 3 SMs / 4). GPU tests in forms 1 and 2; (b) at the five shapes with the engine's row in forms 2 and
# 3 (beside cuBLAS's, the own grid's and 64 blocks'); then the 7B mixed step at batch 4, 8, 16 and 32,
# the four forms alternated, as many rounds as fit.
#   run(command="bash bench/cuda/runs/run382.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
(cd .device && tar -xJf bundle.tar.xz) || exit 1
grep -qa BITDELTA_AB_STREAM_BASE .device/bin/bench_gpu_e2e || { echo "run382.sh: the bundle lacks the switch"; exit 1; }
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
export BITDELTA_CLI_PATH=$root/.device/bin/bitdelta
L=$OUT/run382.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
{
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for ab in 1 2; do
  stamp "gpu tests, form $ab"
  BITDELTA_AB_STREAM_BASE=$ab timeout 60 .device/bin/bitdelta_gpu_tests > $OUT/gpu_tests_$ab.log 2>&1; echo "rc $?"
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure" $OUT/gpu_tests_$ab.log | head -10
done
for ab in 2 3; do
  stamp "(b), the engine's row in form $ab"
  BITDELTA_AB_STREAM_BASE=$ab timeout 90 .device/bin/bench_cuda_fused_linear --many-variants 4096 4096 11008 4096 \
    4096 11008 8192 8192 28672 8192 > /tmp/b.log 2>&1; echo "rc $?"
  grep -E "copy of|b: roofline|route, folded, graph of 20 |alternated|stream base|alone, graph of 20 |after a norm" /tmp/b.log
done
stamp "7B model"
timeout 60 .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 \
  --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -5 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2 3 4; do
  for ab in 0 1 2 3; do
    [ $(( $(date +%s) - t0 )) -gt 330 ] && { stamp "left out: round $round form $ab"; continue; }
    echo "round $round form $ab: $(BITDELTA_AB_STREAM_BASE=$ab timeout 60 .device/bin/bench_gpu_e2e /tmp/l7b \
      --decode 16 --batch 4,8,16,32 --profile-case mixed 2>&1 | grep -E '^batch' | awk '{print $2, $6}' | tr '\n' ' ')"
  done
done
stamp done
} > $L 2>&1
cat $L
