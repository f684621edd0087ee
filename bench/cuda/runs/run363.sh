#!/usr/bin/env bash
# Session 51: where in the 7B step does the stage (S) win? Run 362 (H100): the step-form rows and the
# chains both say A (second batch to L2) is faster at 4096² and 11008×4096 and level at 8192², yet the
# 7B batch-1 step is faster with S. The 7B model's other one-row shapes: q|k|v 12288×4096, gate|up
# 22016×4096, the LM head 32000×4096; 4096² again. S / A alternated, two rounds.
#   run(command="bash bench/cuda/runs/run363.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
(cd .device && tar -xJf bundle.tar.xz) || exit 1
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
L=$OUT/run363.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
{
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
for round in 1 2; do
  for form in S A; do
    if [ $form = A ]; then export BITDELTA_AB_NO_STAGE=1; else unset BITDELTA_AB_NO_STAGE; fi
    stamp "round $round, form $form"
    .device/bin/bench_cuda_fused_linear --one-row 12288 4096 22016 4096 32000 4096 4096 4096 > /tmp/a.log 2>&1
    grep -E "copy of|balanced, chain of 20 |balanced, chain of 20, no delta|after a norm" /tmp/a.log
  done
done
stamp done
} > $L 2>&1
cat $L
