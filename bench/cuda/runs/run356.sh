#!/usr/bin/env bash
# Session 50: two changes to the one-row kernel's start at 4096², switched in one binary:
#   BITDELTA_AB_PF_NEXT=1: the warp's second unit (W's rows and the sign block) sent to L2 once the
#     block's loads of x to quantize are issued;
#   BITDELTA_AB_LATE_Q=1: the block quantizes x inside each warp's first unit, after that unit's first
#     batch is multiplied and its second batch's W is issued by cp.async into shared memory (its round
#     trip overlaps the quantizing) — decode_row_kernel<true, false, true>.
# Forms: A (neither: the committed kernel), P (PF_NEXT), L (LATE_Q), PL (both). One call:
#   run(command="bash bench/cuda/runs/run356.sh", carry=[".device/bundle.tar.xz"])
# Stages: the GPU tests (A and PL) and the kernel checks (A and L); the one-row bench at the five
# shapes, the four forms alternated twice; the 7B model's batch-1 step, the four forms alternated twice.
set -uo pipefail
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run356.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
form_env() {  # form -> env assignments
  case $1 in A) echo "BITDELTA_AB_PF_NEXT=0 BITDELTA_AB_LATE_Q=0" ;; P) echo "BITDELTA_AB_PF_NEXT=1 BITDELTA_AB_LATE_Q=0" ;;
    L) echo "BITDELTA_AB_PF_NEXT=0 BITDELTA_AB_LATE_Q=1" ;; PL) echo "BITDELTA_AB_PF_NEXT=1 BITDELTA_AB_LATE_Q=1" ;; esac
}
{
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv
for f in A PL; do
  stamp "gpu tests, form $f"
  env $(form_env $f) BITDELTA_CLI_PATH=$root/.device/bin/bitdelta .device/bin/bitdelta_gpu_tests \
    > $OUT/gpu_tests_$f.log 2>&1; echo "rc $?"
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure" $OUT/gpu_tests_$f.log | head -20
done
for f in L A; do
  stamp "kernel tests, form $f"
  env $(form_env $f) .device/bin/test_cuda_fused_linear > $OUT/kt_$f.log 2>&1; echo "rc $?"
  grep -E "^FAIL" $OUT/kt_$f.log | head -20; tail -1 $OUT/kt_$f.log
done
for round in 1 2; do
  for f in A P L PL; do
    stamp "one-row bench round $round form $f"
    env $(form_env $f) .device/bin/bench_cuda_fused_linear --one-row 4096 4096 11008 4096 4096 11008 8192 8192 \
      28672 8192 > $OUT/bench_a_${f}_$round.log 2>&1
    grep -E "GemmEx|balanced, chain of 20 |balanced, chain of 20, no delta|chain of 20, after the wait |first batch before the wait  " \
      $OUT/bench_a_${f}_$round.log
  done
done
stamp "7B model"
.device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
  --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -5 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
for round in 1 2; do
  for f in A P L PL; do
    echo "round $round form $f: $(env $(form_env $f) .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 \
      --profile-case "batch 1" 2>&1 | grep -E '^batch' | tr '\n' ' ')"
  done
done
stamp done
} > $L 2>&1
tail -c 9000 $L
