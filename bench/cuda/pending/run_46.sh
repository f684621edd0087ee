#!/usr/bin/env bash
# Written in session 46 (no device lent then), for the next session's first device call, with
# one_row_xq_early_w.patch applied and the bundle made from that tree (tools/device_bundle.sh):
#   git apply bench/cuda/pending/one_row_xq_early_w.patch && tools/device_bundle.sh
#   run(command="bash bench/cuda/pending/run_46.sh", carry=[".device/bundle.tar.xz"])
# In one call (about 6-7 minutes: an estimate from earlier runs' stage times, not measured):
#   1. the GPU tests (the fork of a prefix now copies only that prefix: 645eb23; the norm and SwiGLU
#      writing one row quantized; the model tests with that on, the patch's default) and the kernel
#      checks (the patch's one-row forms: x quantized before, W's first batch before the wait);
#   2. the (b) bench with the route's A/B rows (x's 16 rows quantized before, the terms' quantizing
#      launch left out: alternated twice with the route as it is, graphs of 20; session 47: and with
#      the streaming kernel as the base too, which cuBLAS's launches cannot do), and the one-row
#      bench at the five shapes, with the patch's A/B rows (chains of 20, alternated twice in one
#      process: default, x quantized before, no delta; each with and without early W);
#      Both benches also time the chained read floors of a kernel that needs x from the launch
#      before (session 47): reads after the wait, or only a first batch before it (in registers, or
#      to L2), every form tried chained (read_floor.h ChainWait);
#   3. the end-to-end table on this code (both switches off: the patch leaves the default kernels'
#      PTX unchanged, compared in session 46), the table's figures other than the cold load being
#      run 345's until now;
#   4. the 7B batch-1 steps in four forms, alternated twice: early W off/on (BITDELTA_AB_EARLY_W) ×
#      the norms and SwiGLU writing x quantized for the one-row linears off/on
#      (BITDELTA_AB_PRODUCER_XQ).
# Keep a form if the batch-1 variant steps are faster and the chained rows slower nowhere beyond
# noise (the base's steps do not change with producer xq: it applies to a variant's row only).
set -uo pipefail
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
# The bundle must come from the patched tree (its bench has the patch's A/B rows).
grep -qa "AB balanced, chain of 20" .device/bin/bench_cuda_fused_linear ||
  { echo "run_46.sh: the bundle was not built with one_row_xq_early_w.patch applied"; exit 1; }
grep -qa "first batch to L2 before the wait" .device/bin/bench_cuda_fused_linear &&
  grep -qa "x quantized before, stream base" .device/bin/bench_cuda_fused_linear ||
  { echo "run_46.sh: the bundle predates the dependent chained floors (session 47)"; exit 1; }
L=$OUT/run46.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
{
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv
stamp "gpu tests"
BITDELTA_CLI_PATH=$root/.device/bin/bitdelta .device/bin/bitdelta_gpu_tests > $OUT/gpu_tests.log 2>&1; echo "rc $?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|forked|Quantized" $OUT/gpu_tests.log | head -20
stamp "kernel tests"
.device/bin/test_cuda_fused_linear > $OUT/kt.log 2>&1; echo "rc $?"
grep -E "^FAIL" $OUT/kt.log | head -20; grep -cE "early W|x quantized before: the same" $OUT/kt.log; tail -1 $OUT/kt.log
stamp "bench many-variants"
.device/bin/bench_cuda_fused_linear --many-variants > $OUT/bench_b.log 2>&1; echo "rc $?"
grep -E "b: roofline|b: floor|floor.s form|AB route|x quantized before|route.s" $OUT/bench_b.log
stamp "bench one-row"
.device/bin/bench_cuda_fused_linear --one-row > $OUT/bench_a.log 2>&1; echo "rc $?"
grep -E "AB |x quantized before|reading W, signs, chain|floor.s form|GemmEx" $OUT/bench_a.log
if [ "${1:-}" != short ]; then  # `run_46.sh short`: the tests and the two benches only (about 3 minutes)
stamp "7B model"
.device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
  --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || { tail -5 /tmp/ms.log; }
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json /tmp/l7b/base/
stamp "e2e table"
BITDELTA_AB_PRODUCER_XQ=0 .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --out $OUT/e2e.json > $OUT/e2e.log 2>&1
echo "rc $?"
grep -vE "^v[0-9]|replayed as CUDA" $OUT/e2e.log
stamp "7B batch 1: early W x producer xq"
for round in 1 2; do
  for early in 0 1; do
    for pxq in 0 1; do
      # The call's limit is 600 s: a form started after 540 s is left out (its figure missing, the
      # logs above kept) rather than the whole call cut off.
      [ $(( $(date +%s) - t0 )) -gt 540 ] && { echo "round $round early=$early producer_xq=$pxq: left out (time)"; continue; }
      echo "round $round early=$early producer_xq=$pxq: $(BITDELTA_AB_EARLY_W=$early BITDELTA_AB_PRODUCER_XQ=$pxq \
        .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --profile-case "batch 1" 2>&1 | grep -E '^batch' | tr '\n' ' ')"
    done
  done
done
fi
stamp done
} > $L 2>&1
tail -c 11000 $L
