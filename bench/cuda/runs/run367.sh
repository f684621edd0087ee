#!/usr/bin/env bash
# Session 51, run 367 (as run inline on the H200 after run366.sh, on the same warm machine, with the
# switch bundle of run 365): the 7B batch-1 step with the stage (S) and without (A), two rounds, on a
# model with 2 deltas (the device time left allowed no more; bench_gpu_e2e needs at least two).
set -uo pipefail
export LD_LIBRARY_PATH=$PWD/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$PWD
L=$OUT/run367.log
(
  nvidia-smi --query-gpu=name --format=csv,noheader
  .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
    --tie 0 --shards 3 --finetune 0 --deltas 2 > /tmp/ms.log 2>&1 || tail -3 /tmp/ms.log
  cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
    /tmp/l7b/base/
  for r in 1 2; do
    for f in S A; do
      if [ $f = A ]; then export BITDELTA_AB_NO_STAGE=1; else unset BITDELTA_AB_NO_STAGE; fi
      echo "round $r form $f: $(.device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --profile-case 'batch 1' 2>&1 |
        grep -E '^batch' | tr '\n' ' ')"
    done
  done
) >> $L 2>&1
cat $L
