#!/usr/bin/env bash
# Session 51: the one-row linear in a CUDA graph, as the engine's step runs it (new bench rows
# "graph of 20"), with the stage (S, committed) and without (A: BITDELTA_AB_NO_STAGE, the bundle built
# with runs/run362_ab_no_stage.diff applied), alternated: do graphs find S faster, as the 7B step
# does (runs 359, 362) and the chains do not? On an H200 first run361.sh's table of the committed code.
#   run(command="bash bench/cuda/runs/run365.sh", carry=[".device/bundle.tar.xz"])
set -uo pipefail
root=$(pwd)
export PATH=/usr/local/cuda/bin:$PATH
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
rounds=3
if [[ $gpu == *H200* ]]; then
  bash bench/cuda/runs/run361.sh main > /dev/null 2>&1
  grep -E "^-- |PASSED|FAILED|checks passed" $OUT/run361main.log
  rounds=2
else
  (cd .device && tar -xJf bundle.tar.xz) || exit 1
fi
export LD_LIBRARY_PATH=$root/.device/lib:/usr/local/cuda/lib64 BITDELTA_SOURCE_DIR=$root
grep -qa BITDELTA_AB_NO_STAGE .device/bin/bench_gpu_e2e || { echo "run365.sh: the bundle lacks the switch"; exit 1; }
L=$OUT/run365.log
t0=$(date +%s)
stamp() { echo "-- $(( $(date +%s) - t0 )) s: $*"; }
{
date -u; echo "$gpu"
if [ ! -f /tmp/l7b/deltas/v13.bitdelta ]; then
  stamp "7B model"
  .device/bin/make_synthetic /tmp/l7b --layers 32 --hidden 4096 --inter 11008 --vocab 32000 --heads 32 --kv-heads 32 \
    --tie 0 --shards 3 --finetune 0 --deltas 14 > /tmp/ms.log 2>&1 || tail -5 /tmp/ms.log
  cp models/demo/base/tokenizer.model models/demo/base/tokenizer_config.json models/demo/base/generation_config.json \
    /tmp/l7b/base/
fi
for round in $(seq 1 $rounds); do
  for form in S A; do
    [ $(( $(date +%s) - t0 )) -gt 330 ] && { echo "left out (time): round $round $form"; continue; }
    if [ $form = A ]; then export BITDELTA_AB_NO_STAGE=1; else unset BITDELTA_AB_NO_STAGE; fi
    stamp "round $round, form $form"
    .device/bin/bench_cuda_fused_linear --one-row 4096 4096 11008 4096 12288 4096 4096 11008 > /tmp/a.log 2>&1
    grep -E "copy of|balanced, chain of 20 |balanced, after a norm, chain of 20 pairs less the norms  |graph of 20" /tmp/a.log
    .device/bin/bench_gpu_e2e /tmp/l7b --decode 16 --profile-case "batch 1" 2>&1 | grep -E '^batch'
  done
done
unset BITDELTA_AB_NO_STAGE
stamp done
} > $L 2>&1
cat $L
