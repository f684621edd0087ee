#!/usr/bin/env bash
# Session 50: the one-row kernel's first unit's second batch of W by cp.async into shared memory before
# the wait (BITDELTA_AB_STAGE=1, decode_row_kernel<..., true>) instead of to L2, in one binary with the
# committed form (0). Forms A (0), S (1). One call:
#   run(command="bash bench/cuda/runs/run359.sh", carry=[".device/bundle.tar.xz"])
# Stages: the GPU tests and kernel checks with S; the one-row bench at the five shapes, A and S
# alternated twice; the 7B model's batch-1 steps, A and S alternated three times.
set -uo pipefail
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run359.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
st() { [ $1 = A ] && echo 0 || echo 1; }
{
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv
stamp "gpu tests, S"
BITDELTA_AB_STAGE=1 BITDELTA_CLI_PATH=$root/.device/bin/bitdelta .device/bin/bitdelta_gpu_tests > /tmp/gt.log 2>&1
echo "rc $?"; grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure" /tmp/gt.log | head -20
stamp "kernel tests, S"
BITDELTA_AB_STAGE=1 .device/bin/test_cuda_fused_linear > /tmp/kt.log 2>&1; echo "rc $?"
grep -E "^FAIL" /tmp/kt.log | head -20; tail -1 /tmp/kt.log
for round in 1 2; do
  for f in A S; do
    stamp "one-row bench round $round form $f"
    echo "== round $round form $f" >> $OUT/bench_a.log
    BITDELTA_AB_STAGE=$(st $f) .device/bin/bench_cuda_fused_linear --one-row 4096 4096 11008 4096 4096 11008 8192 8192 \
      28672 8192 > /tmp/b.log 2>&1; cat /tmp/b.log >> $OUT/bench_a.log
    grep -E "balanced, chain of 20 |balanced, chain of 20, no delta" /tmp/b.log | awk '{print $1, $(NF-6)}' | tr '\n' ' '; echo
  done
done
stamp "7B model"
.device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
  --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -5 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2 3; do
  for f in A S; do
    echo "round $round form $f: $(BITDELTA_AB_STAGE=$(st $f) .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 \
      --profile-case "batch 1" 2>&1 | grep -E '^batch' | tr '\n' ' ')"
  done
done
stamp done
} > $L 2>&1
cat $L
