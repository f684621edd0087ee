#!/usr/bin/env bash
# Session 49: the code as committed after runs 352-353 (the norms and SwiGLU no longer write their row
# quantized; early W kept): the normal build's GPU tests and kernel checks, then the 7B model's batch-1
# and mixed batch-32 steps once each. One call:
#   run(command="bash bench/cuda/runs/run354.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run354.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
left() { [ $(( $(date +%s) - t0 )) -gt $1 ] && { echo "left out (time): $2"; return 0; }; return 1; }
{
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv
stamp "gpu tests"
BITDELTA_CLI_PATH=$root/.device/bin/bitdelta .device/bin/bitdelta_gpu_tests > $OUT/gpu_tests.log 2>&1; echo "rc $?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure" $OUT/gpu_tests.log | head -20
stamp "kernel tests"
.device/bin/test_cuda_fused_linear > $OUT/kt.log 2>&1; echo "rc $?"
grep -E "^FAIL" $OUT/kt.log | head -20; tail -1 $OUT/kt.log
stamp "7B model"
.device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
  --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -5 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for c in "batch 1" mixed; do
  left 300 "$c" && continue
  echo "$c: $(.device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --batch 32 --profile-case "$c" 2>&1 | grep -E '^batch' | tr '\n' ' ')"
done
stamp done
} > $L 2>&1
tail -c 6000 $L
