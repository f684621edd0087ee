#!/usr/bin/env bash
# Session 50: the committed code with run 359's stage as the one-row kernel's only form: the GPU tests,
# the kernel checks, the one-row bench at the five shapes and (b) at two, with the new rows "after a
# norm" (the step's form for (a) and (b): NOTES.md part 50), and the 7B batch-1 step. One call:
#   run(command="bash bench/cuda/runs/run360.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run360.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
{
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv
stamp "gpu tests"
BITDELTA_CLI_PATH=$root/.device/bin/bitdelta .device/bin/bitdelta_gpu_tests > /tmp/gt.log 2>&1; echo "rc $?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure" /tmp/gt.log | head -20
stamp "kernel tests"
.device/bin/test_cuda_fused_linear > /tmp/kt.log 2>&1; echo "rc $?"
grep -E "^FAIL" /tmp/kt.log | head -20; tail -1 /tmp/kt.log
stamp "one-row bench"
.device/bin/bench_cuda_fused_linear --one-row 4096 4096 11008 4096 4096 11008 8192 8192 28672 8192 > $OUT/bench_a.log 2>&1
grep -E "GemmEx|balanced, chain of 20 |balanced, chain of 20, no delta|after a norm|add_rmsnorm alone" $OUT/bench_a.log
stamp "many-variants bench (b) at 4096² and 11008×4096"
.device/bin/bench_cuda_fused_linear --many-variants 4096 4096 11008 4096 > $OUT/bench_b.log 2>&1
grep -E "b: roofline|route, folded, graph of 20 |after a norm|add_rmsnorm alone" $OUT/bench_b.log
stamp "7B model, batch 1"
.device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
  --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -5 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2; do
  echo "round $round: $(.device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --profile-case "batch 1" 2>&1 | grep -E '^batch' | tr '\n' ' ')"
done
stamp done
} > $L 2>&1
cat $L
