#!/usr/bin/env bash
# Session 49: the one-row kernel issues its first batch's loads of x (for the base) right after its
# wait, before the block quantizes x, instead of after the quantizing and its barrier. The bundle is
# that code; .device/o355.tar.xz holds the benches of the code before it (1742257). One call:
#   run(command="bash bench/cuda/runs/run355.sh", carry=[".device/bundle.tar.xz", ".device/o355.tar.xz"])
# Stages, most needed first (the session had little device time left): the GPU tests and kernel
# checks; the one-row bench at 4096², 11008×4096 and 4096×11008, old and new alternated twice; the
# 7B model's batch-1 step, old and new alternated twice.
set -uo pipefail
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
(cd .device && tar -xJf bundle.tar.xz && tar -xJf o355.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run355.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
{
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv
stamp "gpu tests"
BITDELTA_CLI_PATH=$root/.device/bin/bitdelta .device/bin/bitdelta_gpu_tests > $OUT/gpu_tests.log 2>&1; echo "rc $?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure" $OUT/gpu_tests.log | head -20
stamp "kernel tests"
.device/bin/test_cuda_fused_linear > $OUT/kt.log 2>&1; echo "rc $?"
grep -E "^FAIL" $OUT/kt.log | head -20; tail -1 $OUT/kt.log
for round in 1 2; do
  for form in old new; do
    b=.device/bin; [ $form = old ] && b=.device/o355
    stamp "one-row bench round $round $form"
    $b/bench_cuda_fused_linear --one-row 4096 4096 11008 4096 4096 11008 > $OUT/bench_a_${form}_$round.log 2>&1
    grep -E "GemmEx|balanced, chain of 20 |chain of 20, after the wait " $OUT/bench_a_${form}_$round.log
  done
done
stamp "7B model"
.device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
  --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -5 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2; do
  for form in old new; do
    b=.device/bin; [ $form = old ] && b=.device/o355
    echo "round $round $form: $($b/bench_gpu_e2e /tmp/l7b --decode 16 --profile-case "batch 1" 2>&1 | grep -E '^batch' | tr '\n' ' ')"
  done
done
stamp done
} > $L 2>&1
tail -c 8000 $L
