#!/usr/bin/env bash
# Session 49: run 352 measured the one-row forms of b77602b slower in the 7B model than the code
# before them (batch 1, one variant: 4.64 / 4.63 ms against 4.40 / 4.39), though faster in the
# kernel bench. This run takes them apart at batch 1. The bundle is HEAD with one temporary switch
# (BITDELTA_AB_PRODUCER_XQ=0: the norms and SwiGLU do not write their row quantized, the linears
# quantize x themselves; W's first batch still before the wait). .device/ab.tar.xz holds the
# session-46 A/B binary (bench_gpu_e2e at 6215809 with one_row_xq_early_w.patch; switches
# BITDELTA_AB_EARLY_W, BITDELTA_AB_PRODUCER_XQ; both off = the code before b77602b). One call:
#   run(command="bash bench/cuda/runs/run353.sh", carry=[".device/bundle.tar.xz", ".device/ab.tar.xz"])
# Stages: the GPU tests (with MixedDecodeStepsOfFewRowsMatchTheCpu on the committed route); the 7B
# model; batch 1 in five forms alternated twice (this build with the switch on and off; the A/B
# binary with its switches 00, 10, 01); the table on this build with the switch off.
set -uo pipefail
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
(cd .device && tar -xJf bundle.tar.xz && tar -xJf ab.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run353.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
left() { [ $(( $(date +%s) - t0 )) -gt $1 ] && { echo "left out (time): $2"; return 0; }; return 1; }
{
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv
stamp "gpu tests"
BITDELTA_CLI_PATH=$root/.device/bin/bitdelta .device/bin/bitdelta_gpu_tests > $OUT/gpu_tests.log 2>&1; echo "rc $?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|FewRows" $OUT/gpu_tests.log | head -20
stamp "7B model"
.device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
  --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -5 /tmp/ms.log
cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
  /tmp/l7b/base/
stamp "7B batch 1: new (early W, producers' xq), new-w (early W), old (ab 00), ab-w (ab 10), ab-p (ab 01)"
for round in 1 2; do
  for form in new new-w old ab-w ab-p; do
    left 330 "batch 1 round $round $form" && continue
    case $form in
      new) b=.device/bin/bench_gpu_e2e; e=1; p=1 ;;
      new-w) b=.device/bin/bench_gpu_e2e; e=1; p=0 ;;
      old) b=.device/ab/bench_gpu_e2e_ab; e=0; p=0 ;;
      ab-w) b=.device/ab/bench_gpu_e2e_ab; e=1; p=0 ;;
      ab-p) b=.device/ab/bench_gpu_e2e_ab; e=0; p=1 ;;
    esac
    echo "round $round $form: $(BITDELTA_AB_EARLY_W=$e BITDELTA_AB_PRODUCER_XQ=$p \
      $b /tmp/l7b --decode 16 --profile-case "batch 1" 2>&1 | grep -E '^batch' | tr '\n' ' ')"
  done
done
stamp "e2e table (switch off)"
if ! left 360 "e2e table"; then
  BITDELTA_AB_PRODUCER_XQ=0 .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --out $OUT/e2e.json > $OUT/e2e.log 2>&1
  echo "rc $?"; grep -vE "^v[0-9]|replayed as CUDA" $OUT/e2e.log
fi
stamp done
} > $L 2>&1
tail -c 11000 $L
