#!/usr/bin/env bash
# Session 51: on an H200 only (any other card: it says which and stops, so that a start that gets an
# H100 costs little): run361.sh's table of the committed code, then the stage (S, committed) against
# the second batch to L2 (A: the temporary switch BITDELTA_AB_NO_STAGE of run 362's bundle), two
# rounds: the one-row bench at 4096², 11008×4096 and 4096×11008, and the 7B batch-1 step.
#   run(command="bash bench/cuda/runs/run364.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
[[ $gpu == *H200* ]] || { echo "run364.sh: $gpu, not an H200: nothing run"; exit 0; }
bash bench/cuda/runs/run361.sh main > /dev/null 2>&1
grep -E "^-- |PASSED|FAILED|checks passed" $OUT/run361main.log
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
grep -qa BITDELTA_AB_NO_STAGE .device/bin/bench_gpu_e2e || { echo "run364.sh: the bundle lacks the switch"; exit 1; }
L=$OUT/run364.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
{
date -u; echo "$gpu"
for round in 1 2; do
  for form in S A; do
    [ $(( $(date +%s) - t0 )) -gt 300 ] && { echo "left out (time): round $round $form"; continue; }
    if [ $form = A ]; then export BITDELTA_AB_NO_STAGE=1; else unset BITDELTA_AB_NO_STAGE; fi
    stamp "round $round, form $form"
    .device/bin/bench_cuda_fused_linear --one-row 4096 4096 11008 4096 4096 11008 > /tmp/a.log 2>&1
    grep -E "copy of|balanced, chain of 20 |balanced, chain of 20, no delta|after a norm" /tmp/a.log
    .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --profile-case "batch 1" 2>&1 | grep -E '^batch'
  done
done
unset BITDELTA_AB_NO_STAGE
stamp done
} > $L 2>&1
cat $L
