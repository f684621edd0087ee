#!/usr/bin/env bash
# Session 56: the issue-6 table again on the engine whose route takes its base through the streaming
# kernel (run 382): GPU tests, (b) at the five shapes (the engine's route beside cuBLAS | terms, the
# streaming base on 64 blocks, x quantized before), the 7B table (bench_gpu_e2e: decode, TTFT,
# memory, cold load), the 7B mixed step at batch 4, 8, 16 and 32 in three more rounds, and the server
# on the demo family. (a) and (c) are unchanged (their paths don't take the route): run 376's.
#   run(command="bash bench/cuda/runs/run383.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
(cd .device && tar -xJf bundle.tar.xz) || exit 1
grep -qa BITDELTA_AB_STREAM_BASE .device/bin/bench_gpu_e2e && { echo "run383.sh: the bundle has run 382's switch"; exit 1; }
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
export BITDELTA_CLI_PATH=$root/.device/bin/bitdelta
L=$OUT/run383.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
{
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
stamp "gpu tests"
timeout 60 .device/bin/bitdelta_gpu_tests > $OUT/gpu_tests.log 2>&1; echo "rc $?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure" $OUT/gpu_tests.log | head -10
stamp "(b) many-variants bench"
timeout 90 .device/bin/bench_cuda_fused_linear --many-variants > $OUT/bench_b.log 2>&1; echo "rc $?"
grep -E "copy of|b: roofline|route, folded, graph of 20 |alternated|stream base|alone, graph of 20 |after a norm" \
  $OUT/bench_b.log
stamp "7B model"
timeout 60 .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 \
  --kv-heads 32 --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -5 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
stamp "e2e table"
timeout 120 .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --out $OUT/e2e.json > /tmp/e2e.log 2>&1; echo "rc $?"
grep -vE "^v[0-9]|replayed as CUDA" /tmp/e2e.log
for round in 1 2 3; do
  [ $(( $(date +%s) - t0 )) -gt 260 ] && { stamp "left out: mixed round $round"; continue; }
  echo "mixed round $round: $(timeout 60 .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --batch 4,8,16,32 \
    --profile-case mixed 2>&1 | grep -E '^batch' | awk '{print $2, $6}' | tr '\n' ' ')"
done
stamp "serve"
BITDELTA_STAGES=serve timeout 90 tools/gpu_run.sh /tmp/serve > /tmp/serve_console.log 2>&1; echo "rc $?"
grep -vE "^(name|NVIDIA|[0-9]+$|Mem:|total|/dev|overlay)" /tmp/serve_console.log | cut -c1-220 | tail -30
stamp done
} > $L 2>&1
cat $L
