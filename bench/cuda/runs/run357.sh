#!/usr/bin/env bash
# Session 50: run 356's second-unit prefetch only where a warp has more than one round of units
# (BITDELTA_AB_PF_NEXT=3: the block's range longer than kWarps · c units; not at 4096², where run 356
# measured it 1.4 µs slower). Forms: A (0, the committed kernel), Q (3). One call:
#   run(command="bash bench/cuda/runs/run357.sh", carry=[".device/bundle.tar.xz"])
# Stages: the GPU tests (Q); the one-row bench at the five shapes, A and Q alternated twice; the 7B
# model's batch-1 steps, A and Q alternated three times. Logs: run357.log, bench_a.log.
set -uo pipefail
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run357.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
pf() { [ $1 = A ] && echo 0 || echo 3; }
{
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv
stamp "gpu tests, form Q"
BITDELTA_AB_PF_NEXT=3 BITDELTA_CLI_PATH=$root/.device/bin/bitdelta .device/bin/bitdelta_gpu_tests > /tmp/gt.log 2>&1
echo "rc $?"; grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure" /tmp/gt.log | head -20
for round in 1 2; do
  for f in A Q; do
    stamp "one-row bench round $round form $f"
    echo "== round $round form $f" >> $OUT/bench_a.log
    BITDELTA_AB_PF_NEXT=$(pf $f) .device/bin/bench_cuda_fused_linear --one-row 4096 4096 11008 4096 4096 11008 8192 8192 \
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
  for f in A Q; do
    echo "round $round form $f: $(BITDELTA_AB_PF_NEXT=$(pf $f) .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 \
      --profile-case "batch 1" 2>&1 | grep -E '^batch' | tr '\n' ' ')"
  done
done
stamp done
} > $L 2>&1
cat $L
