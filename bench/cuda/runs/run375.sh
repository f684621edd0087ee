#!/usr/bin/env bash
# Session 53: the delta terms stored without the fork's memset, as code (no switch; run 374). The GPU
# tests and kernel checks, (b) at 4096² and 11008x4096, the 7B mixed step at batch 32
# and, time left, the batch-1 steps.
# Session 55: its (b) rows include the streaming base forms of 610bc8c and its successor (run376.sh).
#   run(command="bash bench/cuda/runs/run375.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
export BITDELTA_CLI_PATH=$root/.device/bin/bitdelta
L=$OUT/run375.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
{
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
stamp "gpu tests"
timeout 120 .device/bin/bitdelta_gpu_tests > $OUT/gpu_tests.log 2>&1; echo "rc $?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure" $OUT/gpu_tests.log | head -10
stamp "kernel tests"
timeout 150 .device/bin/test_cuda_fused_linear > /tmp/kt.log 2>&1; echo "rc $?"
grep -E "^FAIL" /tmp/kt.log | head -10; grep -E "delta store|terms beside:" /tmp/kt.log | head -4; tail -1 /tmp/kt.log
grep -cE "^ok +delta store" /tmp/kt.log
stamp "(b)"
timeout 90 .device/bin/bench_cuda_fused_linear --many-variants 4096 4096 11008 4096 > $OUT/bench_b.log 2>&1
grep -E "copy of|b: roofline|route, folded, graph of 20 |alone, graph of 20 |after a norm|stream kernel base \||stream base" $OUT/bench_b.log
[ $(( $(date +%s) - t0 )) -gt 110 ] && stamp "7B left out (time)"
[ $(( $(date +%s) - t0 )) -le 110 ] && {
stamp "7B model"
.device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
  --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -5 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1; do
  echo "round $round: $(timeout 60 .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --profile-case mixed 2>&1 |
    grep -E '^batch' | tr '\n' ' ')"
done
[ $(( $(date +%s) - t0 )) -lt 150 ] && echo "batch 1: $(timeout 60 .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 \
  --profile-case "batch 1" 2>&1 | grep -E '^batch' | tr '\n' ' ')"
}
stamp done
} > $L 2>&1
cat $L
